"""Issue 35, items 10 and 9 (the managed Redis's password), against a real redis-server: two deployments on one
Redis never read each other's entries, even under one cluster name (keys namespaced by each cluster's store
secret, state/secret.py), while the replicas and restarts of one deployment share them; the managed Redis
wants the cluster's secret as its password, which no command line shows."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import redis.asyncio as aioredis

from pdserve.plan.build import build_plan
from pdserve.plan.routers import SECRET_FILE
from pdserve.router.config import RouterConfig
from pdserve.router.kv.store_redis import deployment_id, read_secret
from pdserve.spec.load import parse_spec
from pdserve.state.secret import ensure_secret
from pdserve.supervise.health import probe
from tests.kits.fake_vllm import FAKE
from tests.kits.metric_text import reuse_hits
from tests.kits.ports import free_port
from tests.kits.redis_rig import PARAMS, store_at
from tests.kits.router_rig import deployment
from tests.kits.spec_data import GOOD, with_

CHAT = "/v1/chat/completions"


def cluster_secret(folder: Path) -> Path:
    ensure_secret(folder / SECRET_FILE)
    return folder / SECRET_FILE


def with_deployment(url: str, secret: Path) -> str:
    return f"{url}?deployment_file={quote(str(secret))}"


async def turn(dep, history: list, i: int) -> list:
    """One turn of the conversation `same-id`, the same words in every deployment; the history after it."""
    body = {"model": "fake", "messages": history + [{"role": "user", "content": f"turn {i} " * 20}],
            "max_tokens": 4, "conversation_id": "same-id"}
    async with dep.session.post(dep.url + CHAT, json=body) as resp:
        assert resp.status == 200
        data = await resp.json()
    return body["messages"] + [data["choices"][0]["message"]]


async def test_two_clusters_of_one_name_on_one_redis_never_read_each_others_entries(redis_server, tmp_path):
    """Before: keys were namespaced by the cluster name only: B's P was offered A's D's handles (the issue: 80
    of 80 offers), and B's puts, with its D's engine id, dropped A's entries."""
    a, b = cluster_secret(tmp_path / "home-a" / "t"), cluster_secret(tmp_path / "home-b" / "t")
    # A generous store_timeout: this is about namespaces, and a loaded CI box once took over 0.25 s for a take.
    async with deployment(store=with_deployment(redis_server.url, a), cluster="t", store_timeout=5.0) as dep_a, \
            deployment(store=with_deployment(redis_server.url, b), cluster="t", store_timeout=5.0) as dep_b:
        history_a, history_b = [], []
        for i in range(3):                     # turn by turn: the same tenant, conversation id and words in both
            history_a = await turn(dep_a, history_a, i)
            history_b = await turn(dep_b, history_b, i)
        offers = [r["body"]["kv_transfer_params"] for r in dep_b.prefill[0][FAKE].received if r["path"] == CHAT]
        d_a, d_b = dep_a.decode[0][FAKE].engine_id, dep_b.decode[0][FAKE].engine_id
        offered = [o.get("remote_engine_id") for o in offers if "remote_block_ids" in o]
        assert d_a != d_b and offered and set(offered) == {d_b}, offered     # B's P: B's D's handles only
        assert reuse_hits(await dep_a.metrics()) == 2 and reuse_hits(await dep_b.metrics()) == 2   # each its own follow-ups
    raw = aioredis.from_url(redis_server.url)
    try:
        namespaces = {k.decode().split(":e:")[0] for k in await raw.keys("pdserve:*:e:*")}
    finally:
        await raw.aclose()
    assert namespaces == {f"pdserve:t:{deployment_id(read_secret(str(s)))}" for s in (a, b)}, namespaces


async def test_replicas_and_restarts_of_one_cluster_share_its_entries(redis_server, tmp_path):
    secret = cluster_secret(tmp_path / "t")
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    url = with_deployment(redis_server.url, secret)
    first, second = store_at(url, timeout=5.0), store_at(url, timeout=5.0)
    try:
        assert await (await first.put(("t", "c"), PARAMS, "decode-0", 0, [1, 2]))
        assert (await second.take_first([("t", "c")]))[1] == "ok"         # another replica, or after a restart
        other = store_at(with_deployment(redis_server.url, cluster_secret(tmp_path / "other")), timeout=5.0)
        assert await (await other.put(("t", "c"), PARAMS, "decode-0", 0, [1, 2]))
        assert await first.take_first([("t", "c")]) == (None, "no_entry")
        await other.close()
        by_hand = store_at(redis_server.url + "?deployment=mine")           # a router run by hand names its own
        assert by_hand.inner.prefix == "pdserve:t:mine:"
        await by_hand.close()
        assert read_secret(str(secret)) not in first.inner.prefix          # the id is a hash of the secret
    finally:
        await first.close()
        await second.close()
    with pytest.raises(ValueError, match="nowhere.conf"):
        store_at(with_deployment(redis_server.url, tmp_path / "nowhere.conf"))


async def test_the_managed_redis_wants_the_clusters_secret_which_no_command_line_shows(tmp_path):
    """Before: the managed Redis had no password (anything on the machine could write its entries)."""
    folder = tmp_path / "clusters" / "t"
    spec = parse_spec(with_("router.store", "managed", with_("router.store_port", free_port(), GOOD)))
    plan = build_plan(spec, python=sys.executable, cluster_dir=folder, models_dir=tmp_path)
    store = plan.by_name("redis")
    ensure_secret(folder / SECRET_FILE)                                    # what `up` does first
    proc = subprocess.Popen(store.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not probe(store.health_url, 0.5):                           # the supervisor's probe
            assert proc.poll() is None and time.monotonic() < deadline, "the managed Redis did not start"
            await asyncio.sleep(0.05)
        token = read_secret(str(folder / SECRET_FILE))
        assert token.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        raw = aioredis.from_url(f"redis://127.0.0.1:{store.port}/0")
        with pytest.raises(Exception, match="(?i)auth"):
            await raw.set("x", "y")
        await raw.aclose()
        cfg = RouterConfig.from_dict(plan.router_config)
        errors: list = []
        shared = store_at(cfg.store, timeout=5.0, errors=errors)
        try:
            assert await (await shared.put(("t", "c"), PARAMS, "decode-0", 0, [3]))
            assert (await shared.take_first([("t", "c")]))[1] == "ok" and errors == []
        finally:
            await shared.close()
    finally:
        proc.kill()
        proc.wait()
