"""Shell completion of cluster names (typer's `--install-completion` sets up the shell side)."""

from __future__ import annotations

from pdserve.orchestrate import ops


def cluster_names(incomplete: str) -> list[str]:
    return [name for name in ops.cluster_names() if name.startswith(incomplete)]
