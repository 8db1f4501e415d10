"""Checks of the machine and of a running cluster: preflight (before start) and doctor (while running)."""
