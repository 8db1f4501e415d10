"""Data goes to stdout, messages to stderr; NO_COLOR and non-TTY output are honoured by rich."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

# Piped output is for scripts and logs: don't squeeze tables into 80 columns (rich would, for TERM=dumb
# or no terminal, unless given both dimensions).
_piped = {} if sys.stdout.isatty() else {"width": int(os.environ.get("COLUMNS") or 0) or 200, "height": 50}
out = Console(no_color=bool(os.environ.get("NO_COLOR")), soft_wrap=True, **_piped)
err = Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")), soft_wrap=True)


def error(message: str, hint: str | None = None) -> None:
    # Escaped: a message or hint is plain text (a path or a command to copy may hold `[...]`).
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False)
    if hint:
        err.print(f"[yellow]hint:[/] {escape(hint)}", markup=True, highlight=False)


def info(message: str) -> None:
    err.print(message, highlight=False)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def print_text(text: str) -> None:
    """Text as is (a config file), no markup or wrapping."""
    sys.stdout.write(text)
    sys.stdout.flush()


def is_tty() -> bool:
    return err.is_terminal
