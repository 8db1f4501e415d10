"""The CLI reference in Markdown, rendered from the typer app itself (usage, arguments, options, their help
and defaults), so that docs/cli.md cannot drift from the code: `python -m pdserve.cli.reference > docs/cli.md`."""

from __future__ import annotations

import inspect
import sys

import typer.main

from pdserve.cli.main import app

REGENERATE = "python -m pdserve.cli.reference > docs/cli.md"


def commands() -> dict[str, object]:
    """The app's subcommands by name, in the order they are registered."""
    return dict(typer.main.get_command(app).commands)


def options(command) -> list[list[str]]:
    """Each option's spellings (`--help` left out), e.g. [["-n", "--lines"], ["-f", "--follow"]]."""
    return [[*p.opts, *p.secondary_opts] for p in command.params
            if p.param_type_name == "option" and p.name != "help"]


def _cell(text: str) -> str:
    """One table cell: one line, `|` escaped, `<...>` shown rather than read as HTML."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def _params(command, ctx) -> list[str]:
    rows = []
    for p in command.get_params(ctx):
        if p.name == "help":
            continue
        record = p.get_help_record(ctx)
        if record is None:
            continue
        spelled, help_text = record
        names = ", ".join(p.opts)
        value = spelled[len(names):].strip()
        shown = ", ".join(f"`{o}`" for o in p.opts)
        rows.append(f"| {shown} | {f'`{value}`' if value else ''} | {_cell(help_text)} |")
    if not rows:
        return ["No arguments or options besides `--help`."]
    return ["| argument / option | value | description |", "|---|---|---|", *rows]


def _section(title: str, command, ctx) -> list[str]:
    usage = command.get_usage(ctx).removeprefix("Usage: ")
    help_text = inspect.cleandoc(command.help or "")
    return [f"## {title}", "", "```", usage, "```", "", help_text, "", *_params(command, ctx), ""]


def render() -> str:
    root = typer.main.get_command(app)
    ctx = root.make_context("pdserve", [], resilient_parsing=True)
    lines = [f"<!-- Generated from pdserve/cli/ by `{REGENERATE}`; do not edit by hand. -->", "",
             "# CLI reference", "",
             "Every command also takes `--help`. Exit codes and the command table are in the README.", "",
             *_section("`pdserve`", root, ctx)]
    for name, command in root.commands.items():
        sub = type(ctx)(command, info_name=name, parent=ctx)
        lines += _section(f"`pdserve {name}`", command, sub)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
