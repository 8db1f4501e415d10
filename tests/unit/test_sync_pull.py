"""engine/sync_pull.py's policy on fakes of vLLM's NIXL scheduler and worker (the real ones: tests/e2e/
test_real_vllm.py, where a pulled turn's log-probabilities are D's own)."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from pdserve.engine import sync_pull
from pdserve.engine.sync_pull import SYNC_ATTR, decide, drop_reports, mark, read_into, wait_for_reads

OFFER = {"do_remote_decode": True, "remote_block_ids": [[7, 8, 9]], "remote_num_tokens": 90}


def scheduler(**kw):
    return SimpleNamespace(**{"use_host_buffer": False, "_is_hma_required": False, "block_size": 32,
                              "_reqs_need_recv": {}, **kw})


def request(rid="r1", params=OFFER, num_tokens=120):
    return SimpleNamespace(request_id=rid, kv_transfer_params=dict(params), num_tokens=num_tokens)


def test_a_pull_from_d_is_loaded_in_the_step_and_everything_else_as_vllm_said():
    s = scheduler()
    assert decide(s, request(), 0, (90, True)) == (90, False)
    assert decide(s, request("d", {"do_remote_prefill": True, "remote_block_ids": [[1]]}), 0, (90, True)) == (90, True)
    assert decide(s, request("n"), 0, (0, False)) == (0, False)
    assert decide(s, request("w"), 0, (None, False)) == (None, False)     # lookup still running
    assert decide(s, request("all", num_tokens=90), 0, (90, True)) == (90, True)   # no token left to compute
    assert decide(scheduler(use_host_buffer=True), request(), 0, (90, True)) == (90, True)
    assert decide(scheduler(_is_hma_required=True), request(), 0, (90, True)) == (90, True)
    assert set(s._pdserve_sync) == {"r1"}


def test_the_read_goes_to_the_pulled_tokens_blocks_not_the_new_ones():
    # P computed 64 tokens itself (2 blocks), pulls 70 (to token 134: blocks 2..4), and the step allocated
    # blocks for its new tokens too; vLLM's own choice was the unhashed ones.
    s = scheduler()
    r = request(num_tokens=200)
    decide(s, r, 64, (70, True))
    s._reqs_need_recv["r1"] = (r, [[12, 13, 14, 15, 16, 17]], (2,), True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14, 15, 16, 17],))
    read_into(s, r, blocks, 70)
    assert s._reqs_need_recv["r1"] == (r, [[12, 13, 14]], (2,), True)
    s._reqs_need_recv["r1"] = (r, ([12, 13, 14, 15],))       # vLLM 0.26's shape
    read_into(s, r, blocks, 70)
    assert s._reqs_need_recv["r1"] == (r, ([12, 13, 14],))
    other = request("x")
    s._reqs_need_recv["x"] = (other, [[1, 2]], (), True)
    read_into(s, other, blocks, 70)                            # not decided here: left as vLLM made it
    assert s._reqs_need_recv["x"] == (other, [[1, 2]], (), True)


BLOCKS = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13],))


def test_the_step_lists_its_synchronous_reads_and_their_reports_never_reach_vllms_scheduler():
    s = scheduler()
    r = request()
    decide(s, r, 0, (90, True))
    s._reqs_need_recv["r1"] = (r, [[10, 11, 12, 13]], (0,), True)
    read_into(s, r, BLOCKS, 90)
    meta = mark(s, SimpleNamespace(reqs_to_recv={"r1": object(), "async": object()}))
    assert getattr(meta, SYNC_ATTR) == {"r1"}
    out = SimpleNamespace(finished_recving={"r1", "async"})
    drop_reports(s, out)
    assert out.finished_recving == {"async"} and not s._pdserve_sync
    out = SimpleNamespace(finished_recving={"r1"})
    drop_reports(s, out)                                        # reported once only: a second one passes
    assert out.finished_recving == {"r1"}


def test_a_request_another_connector_loads_is_neither_listed_nor_kept_from_vllm():
    # Under a MultiConnector (NIXL beside a CPU tier) the tier may load the request: NIXL's scheduler then gets
    # 0 external tokens and only notifies D, so there is no READ to wait for and vLLM reports nothing.
    s = scheduler()
    r = request()
    decide(s, r, 0, (90, True))
    s._reqs_need_recv["r1"] = (r, [], (), False)
    read_into(s, r, BLOCKS, 0)
    assert s._reqs_need_recv["r1"] == (r, [], (), False) and not s._pdserve_sync
    assert getattr(mark(s, SimpleNamespace(reqs_to_recv={"r1": object()})), SYNC_ATTR) == set()


@dataclass
class Results:
    finished_sending: set = field(default_factory=set)
    finished_recving: set = field(default_factory=set)
    failed_recving: set = field(default_factory=set)


class FakeWorker:
    """vLLM's pull worker as sync_pull sees it: metadata until a completion step reports the request."""

    def __init__(self, done_after: int, tuple_results: bool = False):
        self._recving_metadata = {"r1": object(), "async": object()}
        self._ready_requests = queue.Queue()
        self.polls, self.done_after, self.tuple_results, self.read = 0, done_after, tuple_results, []

    def _read_blocks_for_req(self, rid, meta):
        self.read.append(rid)

    def collect(self):
        self.polls += 1
        sending = {f"sent{self.polls}"}
        recving = set()
        if self.polls == self.done_after:
            self._recving_metadata.pop("r1")
            recving = {"r1"}
        return (sending, recving) if self.tuple_results else Results(sending, recving)


@pytest.mark.parametrize("tuple_results", [False, True], ids=["vllm-0.32", "vllm-0.26"])
def test_the_worker_waits_for_its_reads_and_keeps_every_completion_for_the_engine(tuple_results):
    worker = FakeWorker(done_after=3, tuple_results=tuple_results)
    worker._ready_requests.put(("late", "meta"))                  # a READ whose handshake just finished
    wait_for_reads(worker, {"r1", "gone"}, FakeWorker.collect, limit_s=5)
    assert worker.polls == 3 and worker.read == ["late"] and "async" in worker._recving_metadata
    kept = worker._pdserve_kept
    sending, recving = kept if tuple_results else (kept.finished_sending, kept.finished_recving)
    assert sending == {"sent1", "sent2", "sent3"} and recving == {"r1"}


def test_a_notify_only_request_is_not_waited_for():
    # vLLM 0.26 keeps a full local hit's metadata (empty local blocks) and never reports it: waiting for it
    # would stop the engine.
    worker = FakeWorker(done_after=10**9)
    worker._recving_metadata["r1"] = SimpleNamespace(local_block_ids=[])
    wait_for_reads(worker, {"r1"}, FakeWorker.collect, limit_s=0.05)
    assert worker.polls == 0


def test_a_read_that_never_finishes_stops_the_engine_instead_of_computing_on_it():
    worker = FakeWorker(done_after=10**9)
    with pytest.raises(RuntimeError, match="not done after"):
        wait_for_reads(worker, {"r1"}, FakeWorker.collect, limit_s=0.05)


def test_patched_worker_merges_what_the_wait_kept_into_the_engines_next_call():
    class Worker(FakeWorker):
        def start_load_kv(self, metadata):
            self.started = metadata

        def get_transfer_results(self):
            return self.collect()

    sync_pull.patch_worker(Worker)
    worker = Worker(done_after=1)
    worker.start_load_kv(SimpleNamespace(**{SYNC_ATTR: {"r1"}}))
    after = worker.get_transfer_results()
    assert after.finished_recving == {"r1"} and after.finished_sending == {"sent1", "sent2"}
    assert worker.get_transfer_results().finished_sending == {"sent3"}


def test_off_by_env(monkeypatch):
    monkeypatch.setenv(sync_pull.ENABLE_ENV, "0")
    assert sync_pull.patch_sync_pull().startswith("no")
