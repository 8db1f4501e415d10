"""The cluster's state folder: $PDSERVE_HOME/clusters/<name>/ with plan, state, logs (atomic writes)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.state import targets
from pdserve.state.records import ClusterState


def pdserve_home() -> Path:
    return Path(os.environ.get("PDSERVE_HOME") or Path.home() / ".pdserve").expanduser()


def models_dir() -> Path:
    """Built-in models: $PDSERVE_MODELS when set (one folder shared by several PDSERVE_HOMEs, so each
    builds nothing), else $PDSERVE_HOME/models."""
    shared = os.environ.get("PDSERVE_MODELS")
    return Path(shared).expanduser() if shared else pdserve_home() / "models"


def targets_dir(home: Path | None = None) -> Path:
    """Prometheus file-based discovery: one file per cluster in one folder, so one glob finds them all."""
    return (home or pdserve_home()) / "prometheus"


def write_json_atomic(path: Path, data: Any) -> None:
    """Readers never see a half-written file: write a sibling, then rename over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class ClusterDir:
    def __init__(self, name: str, home: Path | None = None):
        self.name = name
        self.root = (home or pdserve_home()) / "clusters" / name

    plan_path = property(lambda self: self.root / "plan.json")
    state_path = property(lambda self: self.root / "state.json")
    spec_path = property(lambda self: self.root / "cluster.yaml")
    lock_path = property(lambda self: self.root / "supervisor.lock")
    logs_dir = property(lambda self: self.root / "logs")
    supervisor_log = property(lambda self: self.root / "logs" / "supervisor.log")
    requests_dir = property(lambda self: self.root / "requests")   # commands for the running supervisor
    targets_path = property(lambda self: targets_dir(self.root.parent.parent) / f"{self.name}.json")

    def log_path(self, process: str) -> Path:
        return self.logs_dir / f"{process}.log"

    def exists(self) -> bool:
        return self.state_path.exists() or self.plan_path.exists()

    def read_state(self) -> ClusterState | None:
        """The one reader of state.json (None when absent or unreadable; a newer version is an error)."""
        data = read_json(self.state_path)
        return ClusterState.from_dict(data, str(self.logs_dir)) if isinstance(data, dict) else None

    def write_state(self, state: ClusterState) -> None:
        """The one writer of state.json (atomic)."""
        state.updated_at = time.time()
        write_json_atomic(self.state_path, state.to_dict())
        self.write_targets(state)

    def write_targets(self, state: ClusterState) -> None:
        """The cluster's scrape targets (state/targets.py), rewritten only when they change."""
        want = targets.scrape_targets(state)
        if want != read_json(self.targets_path):
            write_json_atomic(self.targets_path, want)

    def read_plan(self) -> dict[str, Any] | None:
        return read_json(self.plan_path)


def list_clusters(home: Path | None = None) -> list[str]:
    base = (home or pdserve_home()) / "clusters"
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if (p / "plan.json").exists())
