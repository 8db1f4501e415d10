"""The `pdserve` CLI as a user runs it (a subprocess), and cluster configs on fake vLLM servers for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import yaml

from pdserve.launchers.local import marked_processes
from tests.kits.ports import free_ports

FAKE_SERVER = str(Path(__file__).resolve().parent / "fake_vllm.py")     # run as a script, one per server


def write_config(tmp_path: Path, name: str, server_args=(), server_command=None, **extra) -> tuple[Path, dict]:
    ports = free_ports(5)
    # The cost guard (cost_aware) prices pulls from measured times, which on fakes are scheduler noise: under
    # load it declined a canary's pull (`pull_slower`) and `doctor` failed; its own tests turn it on.
    router = {"port": ports[4], "cost_aware": False, **extra.pop("router", {})}
    cfg: dict = {
        "name": name, "model": "fake-model",
        "server_command": server_command or [sys.executable, FAKE_SERVER, *server_args],
        "prefill": {"port": ports[0], "nixl_side_channel_port": ports[1]},
        "decode": {"port": ports[2], "nixl_side_channel_port": ports[3]},
        "router": router,
        "supervisor": {"backoff_initial": 0.2, "stop_timeout": 5, "health_interval": 0.5},
        **extra,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def pdserve(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def status_json(name: str) -> dict:
    return json.loads(pdserve("status", name, "--json").stdout)


def all_markers(home: Path, name: str) -> list[psutil.Process]:
    root = home / "clusters" / name
    return [p for proc in ("prefill-0", "decode-0", "router") for p in marked_processes(f"{root}#{proc}")]
