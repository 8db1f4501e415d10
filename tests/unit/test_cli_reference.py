"""The CLI's written descriptions match the typer app: docs/cli.md is what `python -m pdserve.cli.reference`
renders now, and README's command table names every command and every option of each (in that command's
row), and nothing the app does not have."""

from __future__ import annotations

import re
from pathlib import Path

from pdserve.cli import reference

ROOT = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])(?![\w-])")


def command_rows(readme: str) -> dict[str, str]:
    """README's `## Commands` table: command name -> its whole row (every name listed once)."""
    section = readme.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        found = re.match(r"\| `pdserve (\S+?)[ `]", line)
        if found:
            assert found[1] not in rows, f"README's command table lists `{found[1]}` twice"
            rows[found[1]] = line
    return rows


def table_problems(readme: str) -> list[str]:
    """What README's command table gets wrong about the app, one line each."""
    rows, commands = command_rows(readme), reference.commands()
    problems = [f"the app has no command `{name}`" for name in rows if name not in commands]
    problems += [f"`{name}` is missing from the table" for name in commands if name not in rows]
    for name, row in rows.items():
        if name not in commands:
            continue
        spellings = reference.options(commands[name])
        known = {s for option in spellings for s in option}
        problems += [f"`{name}` has no option {flag}" for flag in sorted(set(FLAG.findall(row)) - known)]
        problems += [f"the row of `{name}` does not name {long}" for option in spellings
                     for long in option if long.startswith("--") and long not in row]
    return problems


def test_docs_cli_md_is_the_generated_reference():
    on_disk = (ROOT / "docs" / "cli.md").read_text()
    assert on_disk == reference.render(), f"docs/cli.md is out of date: run `{reference.REGENERATE}`"


def test_readme_command_table_matches_the_app():
    assert table_problems((ROOT / "README.md").read_text()) == []


def test_the_table_check_sees_a_missing_command_a_missing_option_and_an_invented_one():
    readme = (ROOT / "README.md").read_text()
    rows = command_rows(readme)
    wrong = readme.replace(rows["schema"] + "\n", "").replace(rows["status"], rows["status"].replace("--json", "--yaml"))
    problems = table_problems(wrong)
    assert "`schema` is missing from the table" in problems
    assert "`status` has no option --yaml" in problems
    assert "the row of `status` does not name --json" in problems
    assert table_problems(readme.replace("| `pdserve schema`", "| `pdserve schemas`")) == [
        "the app has no command `schemas`", "`schema` is missing from the table"]
