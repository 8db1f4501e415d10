"""Cluster specs for the pure tests (no process): a good spec, one field changed or deleted, the plan made
from one, and a two-host (ssh) topology."""

from __future__ import annotations

import copy
from pathlib import Path

from pdserve.plan.build import build_plan
from pdserve.spec.load import parse_spec

GOOD = {
    "name": "t",
    "model": "org/some-model",
    "prefill": {"port": 8100, "nixl_side_channel_port": 5600, "cpus": [0]},
    "decode": {"port": 8200, "nixl_side_channel_port": 5700, "cpus": [1]},
    "kv_transfer": {"kv_buffer_device": "cpu"},
}


def with_(path: str, value, base=GOOD):
    data = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    if value is DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return data


DELETE = object()

TWO_HOSTS = {
    **GOOD, "launcher": "ssh",
    "hosts": [{"name": "a", "address": "10.77.0.2", "user": "root", "port": 2222,
               "ssh_options": ["UserKnownHostsFile=/k"], "env": {"PYTHONPATH": "/src"}},
              {"name": "b", "address": "10.77.0.3", "python": "/venv/bin/python"}],
    "prefill": {"host": "a", "port": 8100, "nixl_side_channel_port": 5600, "cpus": [0]},
    "decode": {"host": "b", "port": 8100, "nixl_side_channel_port": 5600, "cpus": [0]},
}


def plan_of(data, **kw):
    return build_plan(parse_spec(data), python="/py", cluster_dir=Path("/h/clusters/t"), models_dir=Path("/h/models"))


def arg(argv, flag):
    return argv[argv.index(flag) + 1]
