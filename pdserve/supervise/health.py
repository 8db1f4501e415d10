"""HTTP health probes: ready means the health endpoint answers 200, never "alive N seconds"."""

from __future__ import annotations

import urllib.error
import urllib.request


def probe(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
