"""pdserve.engine.fork_start: a server's children by fork (CPU and GPU platforms), each without the server's socket."""

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
    assert run_code(code).stdout.split()[-2:] == ["yes", "fork"]


def run_code(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None})
    assert res.returncode == 0, res.stderr[-2000:]
    return res


# A GPU platform stood in for by the CPU one answering is_cpu() False; the rest is vLLM's own code: its CLI's
# env setup (which sets spawn where the variable is unset) and the context its engine launcher asks for.
GPU_SERVER = """
import os, socket, sys
from vllm.platforms import current_platform
type(current_platform).is_cpu = lambda self: False
from pdserve.engine.fork_start import start_children_by_fork
server = socket.socket(); server.bind(("127.0.0.1", 0)); port = server.getsockname()[1]
print(start_children_by_fork(["x", "--model", "m", "--port", str(port)]))
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
cli_env_setup()
from vllm.utils.system_utils import get_mp_context
ctx = get_mp_context()
print(ctx.get_start_method())
def child(port, queue):
    from pdserve.engine.fork_start import server_socket_fds
    queue.put(len(server_socket_fds(port)))
queue = ctx.Queue()
proc = ctx.Process(target=child, args=(port, queue)); proc.start(); proc.join(60)
print(queue.get(timeout=10), proc.pid)
"""


def test_on_a_gpu_platform_the_engine_core_is_forked_without_the_server_socket():
    """vLLM's CLI would set spawn (each engine core imports torch and vLLM again, 19-29 s on an H200 host):
    the entry leaves fork, the launcher's context forks, the child has no copy of the server's socket and says
    in the log that it was forked."""
    res = run_code(GPU_SERVER, {"VLLM_WORKER_MULTIPROC_METHOD": None})
    said, method, left = res.stdout.split("\n")[-4:-1]
    assert (said, method) == ("yes", "fork")
    fds, pid = left.split()
    assert fds == "0"
    assert f"pdserve-fork: pid {pid} forked from" in res.stderr
    assert "server sockets closed: 1" in res.stderr


def test_a_method_the_user_set_is_kept():
    res = run_code(GPU_SERVER.split("from vllm.entrypoints")[0] + "print(os.environ['VLLM_WORKER_MULTIPROC_METHOD'])",
                   {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"})
    assert res.stdout.split("\n")[-3:-1] == ["no (VLLM_WORKER_MULTIPROC_METHOD=spawn given)", "spawn"]
