"""Observation readers: Prometheus text, the router's stats, process resources, log files."""
