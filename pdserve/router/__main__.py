"""`python -m pdserve.router --config router.json`"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from pdserve.router import logs
from pdserve.router.app import build_app, server_limits
from pdserve.router.config import RouterConfig
from pdserve.router.limits import GuardedRunner, connection_cap, raise_fd_limit


async def serve(cfg: RouterConfig, host: str, port: int) -> None:
    """Serve until SIGTERM/SIGINT, then drain: stop accepting connections and give in-flight requests
    (streams included) up to drain_timeout to finish, so `pdserve down` loses no answer in progress."""
    log = logging.getLogger("pdserve.router")
    soft, hard = raise_fd_limit()
    cap = connection_cap(cfg.max_connections, soft, cfg.upstream_max_connections)
    log.info("open-file limit %d (hard %d): up to %d client connections, %d upstream", soft, hard, cap,
             cfg.upstream_max_connections)
    # handler_cancellation: a client that disconnects cancels the handler, which closes the upstream requests.
    runner = GuardedRunner(build_app(cfg), max_connections=cap, header_timeout=cfg.header_timeout,
                           handler_cancellation=True, access_log=None, shutdown_timeout=cfg.drain_timeout,
                           **server_limits(cfg))
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("listening on %s:%d", host, port)
    await stop.wait()
    log.info("draining (up to %gs)", cfg.drain_timeout)
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.router")
    parser.add_argument("--config", required=True, help="router JSON written by `pdserve up`")
    parser.add_argument("--host", help="override the bind address")
    parser.add_argument("--port", type=int, help="override the port")
    args = parser.parse_args(argv)
    logs.configure(logging.INFO)
    cfg = RouterConfig.load(args.config)
    loop_factory = None
    try:
        import uvloop   # a faster event loop where available: the router's own cost is mostly loop overhead
        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(cfg, args.host or cfg.host, args.port or cfg.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
