"""The `vllm-router` arm: vLLM's own Rust router (PyPI `vllm-router`) in front of the same vLLM servers,
started by `bench` on a free port and always stopped, so the arms differ only in the router.

Its PD mode with NIXL (`--vllm-pd-disaggregation --kv-connector nixl`) sends P the request with
`max_tokens: 1` and `kv_transfer_params: {do_remote_decode: true}`, then D the request plus P's handles,
as pdserve does; it never hands D's handles back to a P, so nothing comes back from D. Prefill policy
`cache_aware` keeps requests that share a prefix on the P whose cache (by its own prefix tree of request
text) most likely holds it, while load stays within its balance thresholds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from pdserve.errors import PdserveError

PREFILL_POLICY = "cache_aware"
DECODE_POLICY = "round_robin"


@dataclass
class VllmRouter:
    url: str
    version: str
    argv: list[str]
    log: str


def executable() -> str | None:
    """The `vllm-router` script of this Python's environment first (the bench extra installs it there)."""
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if here.exists() else shutil.which("vllm-router")


def version() -> str | None:
    try:
        return metadata.version("vllm-router")
    except metadata.PackageNotFoundError:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def argv(exe: str, port: int, prefill: list[str], decode: list[str], metrics_port: int) -> list[str]:
    # Its metrics exporter binds 29000 unless told otherwise: two runs at once (or anything on 29000) collide.
    args = [exe, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port),
            "--vllm-pd-disaggregation", "--kv-connector", "nixl",
            "--prefill-policy", PREFILL_POLICY, "--decode-policy", DECODE_POLICY,
            "--request-timeout-secs", "600", "--log-level", "warning"]   # 600 s: pdserve's request_timeout
    for url in prefill:
        args += ["--prefill", url]
    for url in decode:
        args += ["--decode", url]
    return args


@contextlib.contextmanager
def running(prefill: list[str], decode: list[str], log_path: Path, ready_timeout: float = 60.0) -> Iterator[VllmRouter]:
    """vllm-router in its own process group for the body; killed (the whole group) after it, even on error."""
    exe = executable()
    if exe is None:
        raise PdserveError("arm vllm-router: the vllm-router package is not installed",
                           hint="pip install 'pdserve[bench]' (or pip install vllm-router)")
    port = _free_port()
    cmd = argv(exe, port, prefill, decode, _free_port())
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "NO_COLOR": "1"})
    try:
        _wait_ready(proc, url, ready_timeout, log_path)
        yield VllmRouter(url, version() or "unknown", cmd, str(log_path))
    finally:
        _stop(proc)


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise PdserveError(f"arm vllm-router: vllm-router exited ({proc.returncode}): {' | '.join(tail)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise PdserveError(f"arm vllm-router: not ready on {url} after {timeout:.0f} s", hint=f"see {log_path}")


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
