"""Run the router and fake vLLM backends in-process on free ports."""

from __future__ import annotations

import argparse
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from pdserve.router.config import RouterConfig
from pdserve.router.front.app import METRICS, build_app, server_limits
from pdserve.router.front.limits import GuardedRunner
from tests.kits.fake_vllm import build_app as build_fake
from tests.kits.fake_vllm import parse_args


@dataclass
class Deployment:
    url: str
    prefill: list[web.Application]
    decode: list[web.Application]
    router: web.Application
    session: aiohttp.ClientSession
    runners: list[web.AppRunner] = field(default_factory=list)

    async def post(self, path: str, body: dict, headers: dict | None = None):
        async with self.session.post(self.url + path, json=body, headers=headers or {}) as resp:
            return resp.status, await resp.json(content_type=None)

    async def stream(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, list[bytes]]:
        async with self.session.post(self.url + path, json={**body, "stream": True}, headers=headers or {}) as resp:
            return resp.status, [line async for line in resp.content if line.strip()]

    async def metrics(self) -> str:
        return await self.metrics_with({})

    async def metrics_with(self, headers: dict) -> str:
        async with self.session.get(self.url + "/metrics", headers=headers) as resp:
            return await resp.text()


async def serve_app(app: web.Application, runner_class=web.AppRunner, **handler_args) -> tuple[web.AppRunner, str]:
    runner = runner_class(app, handler_cancellation=True, **handler_args)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


@asynccontextmanager
async def deployment(prefill_args=([],), decode_args=([],), api_key: str = "", **router_overrides):
    runners: list[web.AppRunner] = []
    p_apps, d_apps, p_cfg, d_cfg = [], [], [], []
    for role, arg_sets, apps, cfgs in (("prefill", prefill_args, p_apps, p_cfg), ("decode", decode_args, d_apps, d_cfg)):
        for i, extra in enumerate(arg_sets):
            app = build_fake(parse_args(list(extra)))
            runner, url = await serve_app(app)
            runners.append(runner)
            apps.append(app)
            cfgs.append({"name": f"{role}-{i}", "url": url})
    # The fakes' conversations are a few dozen tokens: with decode_only on (the shipped default) every
    # follow-up would be served on D alone. Tests of the P-then-D flow get it off; D-alone tests turn it on.
    # The cost guard (cost_aware) prices pulls from measured times, which on fakes are scheduler noise: on a
    # loaded machine it withdrew offers at random (pull_slower). Off here; the tests of the guard turn it on.
    cfg = RouterConfig.from_dict({"prefill": p_cfg, "decode": d_cfg, "model": "fake", "health_interval": 0.1,
                                  "kv_recompute_threshold": 4, "decode_only": False, "cost_aware": False,
                                  **router_overrides})
    router = build_app(cfg, api_key=api_key)
    runner, url = await serve_app(router, GuardedRunner, max_connections=cfg.max_connections, metrics=router[METRICS],
                               header_timeout=cfg.header_timeout, **server_limits(cfg))
    runners.append(runner)
    session = aiohttp.ClientSession()
    dep = Deployment(url, p_apps, d_apps, router, session, runners)
    try:
        await wait_healthy(dep)
        yield dep
    finally:
        await session.close()
        for r in reversed(runners):
            await r.cleanup()


async def wait_healthy(dep: Deployment) -> None:
    import asyncio
    from pdserve.router.front.app import FLOW
    for _ in range(100):
        flow = dep.router[FLOW]
        if all(b.healthy for b in flow.prefill.pool.backends + flow.decode.backends):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("backends never became healthy in the router")


def fake_args(**kw) -> argparse.Namespace:
    return parse_args([f"--{k.replace('_', '-')}" for k, v in kw.items() if v is True])
