"""Supervision: keep every process of a cluster alive (states, restarts with backoff, timed stops, canaries)."""
