"""Prometheus text -> samples, and deltas between two scrapes (what one request, or one arm, did)."""

from __future__ import annotations

from pdserve.observe.promtext import Samples, total


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def prefill_deltas(before: Samples, after: Samples) -> dict[str, float]:
    """What P did between two scrapes: tokens computed here vs pulled from D, KV transfer time and bytes."""
    by_source = "vllm:prompt_tokens_by_source_total"
    return {
        "tokens_computed": delta(before, after, by_source, source="local_compute"),
        "tokens_prefix_cache": delta(before, after, by_source, source="local_cache_hit"),
        "tokens_pulled": delta(before, after, by_source, source="external_kv_transfer"),
        "kv_transfer_s": delta(before, after, "vllm:nixl_xfer_time_seconds_sum"),
        "kv_transfers": delta(before, after, "vllm:nixl_xfer_time_seconds_count"),
        "kv_bytes": delta(before, after, "vllm:nixl_bytes_transferred_sum"),
        "failed_transfers": delta(before, after, "vllm:nixl_num_failed_transfers_total"),
    }
