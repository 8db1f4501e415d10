"""Orchestration: from a cluster.yaml to a supervised deployment and back, for the CLI. No rendering here."""
