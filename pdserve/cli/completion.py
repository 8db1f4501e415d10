"""Shell completion of cluster names (typer's `--install-completion` sets up the shell side)."""

from __future__ import annotations

from pdserve.state.folder import list_clusters


def cluster_names(incomplete: str) -> list[str]:
    return [name for name in list_clusters() if name.startswith(incomplete)]
