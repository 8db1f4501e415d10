"""Multi-turn benchmark building blocks (workloads, metric deltas) for `pdserve bench`."""
