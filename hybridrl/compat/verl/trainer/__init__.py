"""verl's trainer package path."""
