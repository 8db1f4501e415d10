"""pdserve.engine.fork_start: a CPU server's children by fork, each without the server's socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from pdserve.engine.fork_start import close_server_sockets, server_socket_fds, server_port


@pytest.mark.parametrize("argv, port", [
    (["x", "--model", "m", "--port", "8100", "--host", "h"], 8100), (["x", "--port=9"], 9), (["x", "--host", "h"], None),
])
def test_server_port(argv, port):
    assert server_port(argv) == port


def test_a_forked_child_closes_the_bound_server_socket_and_nothing_else():
    """vLLM binds the server's socket, starts its engine, then listens: the child's copy goes before the listen."""
    server, other = socket.socket(), socket.socket()
    try:
        server.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = server.getsockname()[1]
        assert server_socket_fds(port) == [server.fileno()]
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:                                   # the child: close its copy, report what is left
            closed = close_server_sockets(port)
            left = server_socket_fds(port) + [-1] + server_socket_fds(other.getsockname()[1])
            os.write(write, f"{closed} {left}".encode())
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 200).decode() == f"1 {[-1, other.fileno()]}"
        assert server_socket_fds(port) == [server.fileno()]        # the parent keeps its own
    finally:
        server.close()
        other.close()


def test_the_cpu_platform_keeps_fork_for_the_children_it_starts():
    """After vLLM's CPU platform set spawn for its children, the patched configure leaves fork."""
    code = """
import os, sys
from vllm.platforms.cpu import CpuPlatform
def configure(cls, vllm_config):
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"     # what vLLM's CpuPlatform does
CpuPlatform.check_and_update_config = classmethod(configure)
from pdserve.engine.fork_start import start_children_by_fork
print(start_children_by_fork(["x", "--model", "m"]))
CpuPlatform.check_and_update_config(None)
print(os.environ["VLLM_WORKER_MULTIPROC_METHOD"])
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-2:] == ["True", "fork"]
