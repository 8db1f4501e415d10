"""A server's engine core and workers started by fork instead of spawn (FORK_ENV: the planner sets it on every
server pdserve's entry runs, plan/engine_start.py).

vLLM's API server starts its engine core (and workers) with multiprocessing's spawn: on CPU because
CpuPlatform sets VLLM_WORKER_MULTIPROC_METHOD, on GPUs because the CLI does when the variable is unset
(cli_env_setup). Each spawned child then imports torch and vLLM again: ~12 s a process on one core of a
2-core box (two of the ~45 s a server takes to start), 19-29 s for an H200 server's engine core (a third of
its 56-96 s restart, benchmarks/results/2026-12-05-gpu-mps-60a3f3b). Forked, they inherit the imports and
the entry's patches. vLLM's own default outside its CLI is fork, and it still switches to spawn by itself
(and logs why) if CUDA was initialised in the server before its children start. A forked child would also
inherit the API server's socket and keep the port bound after the server died: each child closes its copy,
and says in the server's log that it was forked."""

from __future__ import annotations

import os
import socket
import stat


def server_socket_fds(port: int) -> list[int]:
    """This process's TCP sockets bound to `port` (vLLM binds the server's socket before it starts its engine
    and listens on it only later: the children's copies then listen too)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                    and sock.getsockname()[1] == port):
                out.append(fd)
        except OSError:
            pass
        finally:
            sock.detach()              # the fd stays open: only a probe
    return out


def close_server_sockets(port: int) -> int:
    closed = 0
    for fd in server_socket_fds(port):
        os.close(fd)
        closed += 1
    return closed


def server_port(argv: list[str]) -> int | None:
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    return None


METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def after_fork_in_child(port: int | None) -> None:
    """In each forked child: its copy of the server's socket goes; one line (a raw write: the parent may have
    forked while another thread held stdout's lock) tells the log this child was forked, not spawned."""
    closed = close_server_sockets(port) if port is not None else 0
    os.write(2, f"pdserve-fork: pid {os.getpid()} forked from {os.getppid()}, server sockets closed: "
                f"{closed}\n".encode())


def start_children_by_fork(argv: list[str]) -> str:
    """In the API server process (argv its command line): vLLM starts the server's children by fork, and each
    forked child closes its copy of the server's socket. Says what was done ("yes", or "no (why)")."""
    chosen = os.environ.get(METHOD_ENV)
    if chosen not in (None, "fork"):
        return f"no ({METHOD_ENV}={chosen} given)"
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        from vllm.platforms.cpu import CpuPlatform
        configure = CpuPlatform.check_and_update_config.__func__

        def keep_fork(cls, vllm_config) -> None:
            configure(cls, vllm_config)
            os.environ[METHOD_ENV] = "fork"     # it set spawn

        CpuPlatform.check_and_update_config = classmethod(keep_fork)
    os.environ[METHOD_ENV] = "fork"      # vLLM's CLI sets spawn only where the variable is unset
    port = server_port(argv)
    os.register_at_fork(after_in_child=lambda: after_fork_in_child(port))
    return "yes"
