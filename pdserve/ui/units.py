"""Quantities as people read them."""

from __future__ import annotations


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def address(host: str, port: int) -> str:
    """host:port; a process that listens on no port (the MPS daemon: port 0) by its host alone."""
    return f"{host}:{port}" if port else host
