"""`pdserve bench`: arms, multi-turn workloads, metric deltas and reports."""
