"""The cluster's store secret (issue 35, items 9 and 10): one random token per cluster state folder, made once
by `pdserve up` and kept there (plan/routers.py's SECRET_FILE, mode 0600), so it outlives every process.

It is a Redis config line, `requirepass TOKEN`: the managed Redis includes the file (its password, on no
command line), and the routers read it (router/kv/store_redis.py): the password, and its hash as the deployment
id that namespaces the cluster's keys in a shared Redis. Every replica reads the one file; no other cluster
has it, even under the same name (another PDSERVE_HOME, another machine).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

HEADER = ("# pdserve's store secret for this cluster: the managed Redis's password (it includes this file) and,\n"
          "# hashed, the namespace of the cluster's keys in a shared Redis. Made once by `pdserve up`; private.\n")


def ensure_secret(path: Path) -> None:
    """Make the secret file unless there is one: written whole under another name, then linked into place
    (two `up`s at once: the first link wins, and nobody ever reads half a file)."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(HEADER + f"requirepass {secrets.token_hex(32)}\n")
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
