"""What an operator uses on a running or finished federation: the live view and its metrics endpoint."""
