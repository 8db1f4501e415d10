"""The cluster's secrets: random tokens per cluster state folder, made once by `pdserve up` and kept there
(mode 0600), so they outlive every process.

The store secret (issue 35, items 9 and 10; plan/routers.py's SECRET_FILE)
is a Redis config line, `requirepass TOKEN`: the managed Redis includes the file (its password, on no
command line), and the routers read it (router/kv/store_redis.py): the password, and its hash as the deployment
id that namespaces the cluster's keys in a shared Redis. Every replica reads the one file; no other cluster
has it, even under the same name (another PDSERVE_HOME, another machine).

The control secret (CONTROL_FILE; issue 45, item 3) is the token D's held-KV control routes require: the
supervisor reads it into its environment (router/wire.py's CONTROL_TOKEN_ENV), its servers get it the way they
get the API key (a plan's env_from: never on a command line), and so do the routers. Nothing else has it, so
whatever reaches D's port cannot list, release or pin another tenant's held turns.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

CONTROL_FILE = "control-secret"
CONTROL_HEADER = ("# pdserve's control secret for this cluster: the token the decode servers' held-KV routes\n"
                  "# require of the router. Made once by `pdserve up`; private.\n")
HEADER = ("# pdserve's store secret for this cluster: the managed Redis's password (it includes this file) and,\n"
          "# hashed, the namespace of the cluster's keys in a shared Redis. Made once by `pdserve up`; private.\n")


def ensure_secret(path: Path, control: bool = False) -> None:
    """Make the secret file unless there is one (the store's, or with `control` the control secret): written
    whole under another name, then linked into place (two `up`s at once: the first link wins, and nobody ever
    reads half a file)."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            token = secrets.token_hex(32)
            f.write(CONTROL_HEADER + token + "\n" if control else HEADER + f"requirepass {token}\n")
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def control_token(root: Path) -> str | None:
    """The control secret's token in a cluster's state folder; None when there is none (made by an older
    pdserve, or a folder `up` never wrote)."""
    try:
        lines = (root / CONTROL_FILE).read_text().splitlines()
    except OSError:
        return None
    tokens = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return tokens[-1] if tokens else None
