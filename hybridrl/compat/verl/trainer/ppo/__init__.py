"""verl's trainer.ppo package path."""
