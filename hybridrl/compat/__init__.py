"""Other frameworks' module paths over hybridrl's own classes, so their users' files port by changing imports."""
