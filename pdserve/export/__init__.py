"""Exporters: the same plan the launchers start, rendered for another place to run it (ARCHITECTURE.md §3).

An exporter reads the plan's records (argv, env, ports, health URL, side-channel ports, start order) and
replaces only what the plan marks as host-specific (records.py: ProcessPlan.host_specific); it never
re-derives a server's command line. One module per target, one line each in EXPORTERS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (a config file in a ConfigMap), no line folding (argv stays whole),
    no anchors: each object reads whole on its own."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None     # PyYAML falls back to quotes where a block cannot hold it
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(documents: list[dict[str, Any]]) -> str:
    """YAML documents, each opened with `---`, keys in the order they were built."""
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=1_000_000,
                         default_flow_style=False)


@dataclass
class Export:
    documents: list[dict[str, Any]]                   # the objects, in apply order
    notes: list[str] = field(default_factory=list)     # the mapping rules this config needed, one line each

    def yaml(self) -> str:
        return to_yaml(self.documents)

    def files(self) -> dict[str, str]:
        """One file per object, numbered in apply order (`kubectl apply -f DIR` reads a folder by name)."""
        return {f"{i:02d}-{d['kind'].lower()}-{d['metadata']['name']}.yaml": to_yaml([d])
                for i, d in enumerate(self.documents)}


def _kubernetes(spec, **options) -> Export:
    from pdserve.export.kubernetes import export_kubernetes
    return export_kubernetes(spec, **options)


# target name -> exporter(spec, **options); imported when first used.
EXPORTERS: dict[str, Callable[..., Export]] = {"kubernetes": _kubernetes}

__all__ = ["EXPORTERS", "Export"]
