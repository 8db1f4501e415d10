"""What every check reports: one Finding, ok / warn / fail, with a one-line message and a hint."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    level: str           # ok | warn | fail
    check: str
    message: str
    hint: str = ""
