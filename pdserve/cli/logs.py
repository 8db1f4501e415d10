"""Show a cluster's logs: one process's (PROCESS, e.g. decode-0, router, supervisor) or the last lines of
every process's. Logs live in $PDSERVE_HOME/clusters/NAME/logs/ and are rotated by size (NAME.log.1, ...).
Exit 3 when there is no such cluster."""

from __future__ import annotations

import sys

import typer

from pdserve.cli.completion import cluster_names
from pdserve.orchestrate import ops

NAME = "logs"


def command(
    name: str = typer.Argument(..., help="Cluster name.", autocompletion=cluster_names),
    process: str = typer.Argument(None, help="Process name (prefill-0, decode-0, router, supervisor); "
                                             "default: all of them."),
    lines: int = typer.Option(40, "-n", "--lines", help="How many of the last lines to show."),
    follow_: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines (Ctrl-C stops)."),
) -> None:
    got = ops.logs(name, process, lines)
    out = sys.stdout
    for proc, proc_lines in got.items():
        prefix = f"{proc}| " if len(got) > 1 else ""
        for line in proc_lines:
            out.write(prefix + line + "\n")
    out.flush()
    if follow_:
        try:
            for line in ops.follow_log(name, process):
                out.write(line + "\n")
                out.flush()
        except KeyboardInterrupt:
            pass
