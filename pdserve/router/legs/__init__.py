"""A turn's way through the servers: the flow (flow, turn), its plan (plan, offer), its book of what it takes,
leaves and how it ends (book), the P and D legs (prefill, decode), the stream relay (relay), and calls to a
server (upstream; client, the one backend-client contract; http1, bigjson)."""
