"""Print the JSON Schema of cluster.yaml (generated from pdserve's config models), for editors."""

from __future__ import annotations

from pdserve.orchestrate import ops
from pdserve.ui import console

NAME = "schema"


def command() -> None:
    console.print_json(ops.schema())
