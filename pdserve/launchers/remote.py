"""The program every remote launcher sends to a host's Python (over ssh, as an srun step, through kubectl
exec alike): remote_ops.py's source and one request. The remote side reads it from stdin, so nothing of the
request is quoted through a remote shell, and nothing of pdserve is installed there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REMOTE_OPS = (Path(__file__).with_name("remote_ops.py")).read_text()
BOOTSTRAP = "import sys; exec(compile(sys.stdin.read(), 'pdserve-remote-ops', 'exec'))"


def remote_argv(python: str | None) -> list[str]:
    """The command that runs the program on the host: its Python, reading the program from stdin."""
    return [python or "python3", "-c", BOOTSTRAP]


def program(request: dict[str, Any]) -> str:
    """remote_ops.py's source followed by the call that answers `request` (one JSON line on stdout)."""
    return f"{REMOTE_OPS}\nmain(json.loads({json.dumps(request)!r}))\n"
