"""A turn's way through the servers: the flow (flow, turn), the P and D legs (prefill, decode), the stream
relay (relay), calls to a server (upstream) and the servers' health (backends, breaker)."""
