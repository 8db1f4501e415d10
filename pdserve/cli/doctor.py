"""Check a deployment against this machine: vLLM and NIXL versions, configured cores and GPUs, the EFA
provider, free ports; and, when the cluster is running, that its router answers, that a canary request
moves KV from prefill to decode and back at a rate above the floor (fails below it), and the NIXL transfer
rate each server measured over its life (warns below it). One line per check; exit 1 when any check fails."""

from __future__ import annotations

from pathlib import Path

import typer

from pdserve.errors import EXIT_ERROR
from pdserve.orchestrate import ops
from pdserve.ui import console

NAME = "doctor"


def command(
    config: Path = typer.Argument(None, help="cluster.yaml (default: the embedded configs/local-cpu.yaml)"),
    min_gbps: float = typer.Option(None, "--min-gbps", help="Fail when the canary's KV transfers run below this "
                                                           "many GB/s (default: kv_transfer.min_transfer_gbps, "
                                                           "5 on GPU buffers, none on CPU; 0: no floor)."),
) -> None:
    findings = ops.doctor(config, min_gbps)
    for f in findings:
        style = {"ok": "green", "warn": "yellow", "fail": "bold red"}[f.level]
        console.out.print(f"[{style}]{f.level:4s}[/] {console.escape(f'{f.check}: {f.message}')}", highlight=False)
        if f.hint and f.level != "ok":      # plain text: a command to copy may hold [...]
            console.out.print(f"     hint: {f.hint}", highlight=False, markup=False)
    if any(f.level == "fail" for f in findings):
        raise typer.Exit(EXIT_ERROR)
