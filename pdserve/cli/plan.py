"""Print the exact processes `up` would start (argv, added environment, host, ports) and check them against
this machine (vLLM/NIXL versions, cores and GPUs, EFA provider, free ports); start nothing. Exit 1 when a
check fails."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from pdserve.errors import EXIT_ERROR
from pdserve.orchestrate import ops
from pdserve.ui import console
from pdserve.ui.units import address

NAME = "plan"


def command(
    config: Path = typer.Argument(None, help="cluster.yaml (default: the embedded configs/local-cpu.yaml)"),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    result = ops.plan(config)
    plan, failed = result.plan, result.failed
    if json_out:
        console.print_json({**plan.to_dict(), "state_dir": str(result.state_dir),
                            "preflight": [vars(f) for f in result.findings]})
        if failed:
            raise typer.Exit(EXIT_ERROR)
        return
    # Plain lines, never truncated: the argv must be exact and copyable.
    for proc in plan.processes:
        side = f"  nixl side channel {', '.join(map(str, proc.side_channel_ports))}" if proc.side_channel_ports else ""
        where = f"host {proc.host_name} ({plan.launcher}) " if plan.is_remote(proc) else ""
        console.out.print(f"[bold]{proc.name}[/] ({proc.role})  {where}{address(proc.host, proc.port)}{side}  "
                          f"health {proc.health_url}", highlight=False)
        console.out.print("  env:  " + " ".join(shlex.quote(f"{k}={v}") for k, v in proc.env.items()),
                          markup=False, highlight=False)
        console.out.print("  argv: " + shlex.join(proc.argv), markup=False, highlight=False)
        for name, why in proc.defaults.items():
            console.out.print(f"  set by pdserve: {name}={proc.env[name]}: {why}", markup=False, highlight=False)
    console.out.print(f"router URL: {plan.router_url}   state: {result.state_dir}", highlight=False)
    for f in failed:
        console.error(f"preflight {f.check}: {f.message}", f.hint or None)
    if failed:
        raise typer.Exit(EXIT_ERROR)
