"""`python -m pdserve.router --config router.json`"""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from pdserve.router.app import build_app, server_limits
from pdserve.router.config import RouterConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.router")
    parser.add_argument("--config", required=True, help="router JSON written by `pdserve up`")
    parser.add_argument("--host", help="override the bind address")
    parser.add_argument("--port", type=int, help="override the port")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    cfg = RouterConfig.load(args.config)
    # handler_cancellation: a client that disconnects cancels the handler, which closes the upstream requests.
    loop = None
    try:
        import uvloop   # a faster event loop where available: the router's own cost is mostly loop overhead
        loop = uvloop.new_event_loop()
    except ImportError:
        pass
    web.run_app(build_app(cfg), host=args.host or cfg.host, port=args.port or cfg.port, loop=loop,
                handler_cancellation=True, access_log=None, print=None, **server_limits(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
