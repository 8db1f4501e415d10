"""`python -m pdserve.router --config router.json`"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import signal
import sys

from aiohttp import web

from pdserve.router.config import RouterConfig
from pdserve.router.front import drain
from pdserve.router.front.app import DRAINING, FLOW, METRICS, build_app, server_limits

from pdserve.router.front.limits import GuardedRunner, fd_budget, raise_fd_limit
from pdserve.router.telemetry import logs


def fit_descriptors(cfg: RouterConfig) -> RouterConfig:
    """The config with client and upstream connection caps that fit the open-file limit together (the
    upstream pool shrinks too: sized from the full pool, the client cap once fell to 1). Raises
    TooFewDescriptors (a SystemExit with the reason) when no workable split fits."""
    log = logging.getLogger("pdserve.router")
    soft, hard = raise_fd_limit()
    clients, upstream = fd_budget(soft, cfg.max_connections, cfg.upstream_max_connections)
    log.info("open-file limit %d (hard %d): up to %d client connections, %d upstream", soft, hard, clients,
             upstream)
    if (clients, upstream) != (cfg.max_connections, cfg.upstream_max_connections):
        log.warning("the open-file limit %d does not fit max_connections %d + upstream_max_connections %d: "
                    "lowered to %d + %d; raise the hard limit (ulimit -Hn, LimitNOFILE=) for more", soft,
                    cfg.max_connections, cfg.upstream_max_connections, clients, upstream)
    return dataclasses.replace(cfg, max_connections=clients, upstream_max_connections=upstream,
                               upstream_max_per_backend=min(cfg.upstream_max_per_backend, upstream))


# A request allocates a few hundred objects, almost none in reference cycles; with CPython's default
# thresholds (700, 10, 10) the collector ran ~80 us per request and paused the loop up to 57 ms (a full
# collection walking every module object). Collected more rarely, and the startup heap left out of it.
GC_THRESHOLDS = (20_000, 20, 50)
# A replica's SIGTERM: how long it goes on answering (each answer closing its connection) before it stops
# listening and closes its idle connections. Clients that send within it never meet a connection closed under
# them; longer would only keep new connections coming to a replica on its way out.
REPLICA_DRAIN_GRACE_S = 1.0


def quiet_gc() -> None:
    """Freeze what startup built (imports, the app) out of the collector's walks, then collect rarely."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def serve(cfg: RouterConfig, host: str, port: int, own_port: int | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain: stop accepting connections and give in-flight requests
    (streams included) up to drain_timeout to finish, so `pdserve down` loses no answer in progress.
    A replica (`own_port` given) shares `port` with its siblings (SO_REUSEPORT) and has `own_port` alone."""
    log = logging.getLogger("pdserve.router")
    app = build_app(cfg)
    # handler_cancellation: a client that disconnects cancels the handler, which closes the upstream requests.
    runner = GuardedRunner(app, max_connections=cfg.max_connections, header_timeout=cfg.header_timeout,
                           metrics=app[METRICS], handler_cancellation=True, access_log=None,
                           shutdown_timeout=cfg.drain_timeout + drain.CUT_GRACE_S, **server_limits(cfg))

    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_port=own_port is not None).start()
    if own_port is not None:
        await web.TCPSite(runner, host, own_port).start()
    quiet_gc()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("listening on %s:%d%s", host, port, f" (shared) and {own_port}" if own_port is not None else "")
    await stop.wait()
    stopping = loop.time()
    log.info("draining: %d turn(s) in flight, waiting up to %gs for them (router.drain_timeout)",
             len(app[drain.IN_FLIGHT]), cfg.drain_timeout)

    if own_port is not None:
        # A replica: it stops listening (new connections go to its siblings), then for a moment still answers
        # on the connections it has, each answer with Connection: close (app.DRAINING), so that clients on
        # kept-alive connections leave them after an answer instead of sending a request into one closed
        # under them.
        for site in list(runner.sites):
            await site.stop()
        app[DRAINING].set()
        await asyncio.sleep(min(REPLICA_DRAIN_GRACE_S, cfg.drain_timeout / 2))
    # Past the limit the cutter logs, counts and cancels each turn left, just before aiohttp's own shutdown
    # timeout (the runner's, CUT_GRACE_S later) would cancel it without a word.
    cutter = asyncio.create_task(drain.finish_or_cut(app, app.get(FLOW), app[METRICS], cfg.drain_timeout))
    # stops listening, closes idle connections, waits for the turns, then app cleanup
    cleanup = asyncio.create_task(runner.cleanup(), name="runner.cleanup")
    watch = asyncio.create_task(drain.report_if_stuck(cutter, cleanup))
    await cleanup
    watch.cancel()
    cut = cutter.result() if cutter.done() and not cutter.cancelled() and cutter.exception() is None else 0
    cutter.cancel()

    log.info("drained in %.1fs: %d turn(s) cut", loop.time() - stopping, cut)



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.router")
    parser.add_argument("--config", required=True, help="router JSON written by `pdserve up`")
    parser.add_argument("--host", help="override the bind address")
    parser.add_argument("--port", type=int, help="override the port")
    parser.add_argument("--replica", default="", help="this replica's name (router.replicas > 1)")
    parser.add_argument("--own-port", type=int, help="this replica's own port, beside the shared one")
    args = parser.parse_args(argv)
    logs.configure(logging.INFO)
    cfg = fit_descriptors(dataclasses.replace(RouterConfig.load(args.config), replica=args.replica))
    if cfg.json_logs:
        logs.json_request_lines()
    loop_factory = None
    try:
        import uvloop   # a faster event loop where available: the router's own cost is mostly loop overhead
        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(cfg, args.host or cfg.host, args.port or cfg.port, args.own_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
