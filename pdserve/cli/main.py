"""`pdserve`: bring up, inspect and stop a P/D disaggregated vLLM deployment."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import typer

from pdserve import __version__
from pdserve.errors import PdserveError
from pdserve.ui import console

app = typer.Typer(
    name="pdserve", no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
    help="One command for prefill/decode disaggregated vLLM with bidirectional NIXL KV reuse.\n\n"
         "Exit codes: 0 ok, 1 error, 2 bad input, 3 not running.")


def handle_errors(fn: Callable) -> Callable:
    """Map PdserveError to `error:` + `hint:` lines on stderr and its exit code."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PdserveError as err:
            console.error(err.message, err.hint)
            raise typer.Exit(err.exit_code) from None
    return wrapper


def version_callback(value: bool) -> None:
    if value:
        sys.stdout.write(f"pdserve {__version__}\n")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=version_callback, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    pass


def register() -> None:
    from pdserve.cli import (bench, dashboard, doctor, down, export, logs, plan, restart, schema, scrape_config,
                             status, up)
    for module in (up, status, down, restart, logs, plan, doctor, bench, export, schema, dashboard, scrape_config):
        app.command(module.NAME, help=module.__doc__)(handle_errors(module.command))


register()


if __name__ == "__main__":
    app()
