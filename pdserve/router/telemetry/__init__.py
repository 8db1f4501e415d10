"""What the router reports: Prometheus metrics and their names, logs, and traces (tracing, otel)."""
