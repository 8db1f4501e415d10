"""Print the JSON Schema of cluster.yaml (generated from pdserve's config models), for editors."""

from __future__ import annotations

from pdserve.spec.schema import ClusterSpec
from pdserve.ui import console

NAME = "schema"


def command() -> None:
    console.print_json(ClusterSpec.model_json_schema())
