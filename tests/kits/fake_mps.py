"""A stand-in for NVIDIA's nvidia-cuda-mps-control on a machine without a GPU, to drive pdserve's handling of
the MPS daemon (plan/gpu_sharing.py, supervise/health.py) as the real program is driven. `-f` runs the control
daemon in the foreground: it listens on a Unix socket `control` in $CUDA_MPS_PIPE_DIRECTORY (which must exist,
as for the real one) until its client sends `quit` or it gets SIGTERM. Without arguments it is that daemon's client: it sends the command read from
stdin and exits 0 when a daemon answers there, 1 when none does (as the real client). Real MPS is measured on
the H200 (docs/gpu.md, 2026-12-05)."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPT = """#!{python}
import os, signal, socket, sys
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
path = os.path.join(pipe, "control")
if sys.argv[1:] == ["-f"]:
    if not os.path.isdir(pipe):
        sys.exit("no pipe directory " + pipe)
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(8)
    def stop(*_):
        os.unlink(path)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print("control daemon up in", pipe, flush=True)
    while True:
        conn, _ = server.accept()
        command = conn.recv(256)
        conn.close()
        if command.strip() == b"quit":
            print("quit", flush=True)
            stop()
else:
    command = sys.stdin.readline()
    try:
        client = socket.socket(socket.AF_UNIX)
        client.connect(path)
        client.sendall(command.encode())
        client.close()
    except OSError:
        sys.exit("Cannot find MPS control daemon process")
"""


def install_fake_mps(bin_dir: Path) -> Path:
    """nvidia-cuda-mps-control in `bin_dir` (put it first on PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "nvidia-cuda-mps-control"
    path.write_text(SCRIPT.format(python=sys.executable))
    path.chmod(0o755)
    return path
