"""Print the exact processes `up` would start (argv, added environment, host, ports); start nothing."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from pdserve.cluster import plan_from_file
from pdserve.ui import console

NAME = "plan"


def command(
    config: Path = typer.Argument(None, help="cluster.yaml (default: the embedded configs/local-cpu.yaml)"),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    _, plan, cdir = plan_from_file(config)
    if json_out:
        console.print_json({**plan.to_dict(), "state_dir": str(cdir.root)})
        return
    # Plain lines, never truncated: the argv must be exact and copyable.
    for proc in plan.processes:
        side = f"  nixl side channel {', '.join(map(str, proc.side_channel_ports))}" if proc.side_channel_ports else ""
        console.out.print(f"[bold]{proc.name}[/] ({proc.role})  {proc.host}:{proc.port}{side}  "
                          f"health {proc.health_url}", highlight=False)
        console.out.print("  env:  " + " ".join(shlex.quote(f"{k}={v}") for k, v in proc.env.items()),
                          markup=False, highlight=False)
        console.out.print("  argv: " + shlex.join(proc.argv), markup=False, highlight=False)
    console.out.print(f"router URL: {plan.router.url}   state: {cdir.root}", highlight=False)
