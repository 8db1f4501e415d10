"""The background supervisor process: `python -m pdserve.supervise CLUSTER_DIR`.

`pdserve up` starts it in its own session; it holds the cluster's lock for its whole life.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import sys
from pathlib import Path

from pdserve.plan.records import ClusterPlan
from pdserve.router.wire import CONTROL_TOKEN_ENV
from pdserve.state.folder import ClusterDir
from pdserve.state.secret import CONTROL_FILE, control_token, ensure_secret
from pdserve.supervise.supervisor import Supervisor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.supervise")
    parser.add_argument("cluster_dir", type=Path)
    parser.add_argument("--adopt", action="store_true",
                        help="take over live processes recorded in state.json (their supervisor died)")
    args = parser.parse_args(argv)
    root: Path = args.cluster_dir
    cdir = ClusterDir(root.name, home=root.parent.parent)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    lock = open(cdir.lock_path, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        logging.error("another supervisor holds %s", cdir.lock_path)
        return 1
    plan = ClusterPlan.from_dict(cdir.read_plan())
    # D's held-KV routes answer only the holder of the cluster's control token: every process this supervisor
    # starts gets it from here (a server through its plan's env_from, the routers by inheritance).
    ensure_secret(root / CONTROL_FILE, control=True)
    token = control_token(root)
    if token:
        os.environ[CONTROL_TOKEN_ENV] = token
    return Supervisor(plan, cdir, adopt=args.adopt).run()


if __name__ == "__main__":
    sys.exit(main())
