#!/bin/bash
# Issue 44 item 3 on a host with cores to spare (the H200 node: 16), no GPU used: bench_router.py's pdserve and
# vllm-router arms with the router alone on one physical core and the load side spread over the others, so the
# load side is not the limit (on the 2-core VM it was, in every vllm-router cell at 64 clients).
# Wheels in .whl/ (vllm-router, and what the node's image lacks of pdserve's router: orjson, httptools, hiredis,
# redis), installed into /tmp/site. Results in $OUT (or /tmp/out).
#   benchmarks/router/run-host.sh wheels           here (where pip reaches PyPI): those wheels into .whl/
#   benchmarks/router/run-host.sh [RUNS] [DURATION] on the host, e.g. by the device tool with carry [".whl"]
set -u
code=$(cd "$(dirname "$0")/../.." && pwd)
if [ "${1:-}" = wheels ]; then   # for the node's Python 3.12; vllm-router needs setproctitle, fastapi, uvicorn
  grep -qx '/.whl/' "$code/.git/info/exclude" 2>/dev/null || echo '/.whl/' >> "$code/.git/info/exclude"
  plats=""; for t in 2_5 2_17 2_28; do plats="$plats --platform manylinux_${t}_x86_64"; done
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 $plats -d "$code/.whl" vllm-router==0.1.17 \
    orjson==3.13.0 httptools==0.9.0 hiredis==3.5.0 redis==8.2.0 setproctitle==1.3.8 fastapi==0.136.3 \
    starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 annotated-doc==0.0.7
fi
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$code"/.whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$code PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
# The router on CPU 1; its SMT sibling left idle; the backends and the load generators on the other CPUs.
sib=$(cat /sys/devices/system/cpu/cpu1/topology/thread_siblings_list)
free=$(python3 -c "
import os,sys
busy={0,1}|{int(c) for part in '$sib'.split(',') for c in (range(int(part.split('-')[0]),int(part.split('-')[-1])+1))}
print(' '.join(str(c) for c in sorted(os.sched_getaffinity(0)-busy)))")
set -- ${1:-2} ${2:-5} $free
runs=$1 dur=$2; shift 2
cpus=("$@"); n=${#cpus[@]}; nb=$(( n / 3 )); [ "$nb" -ge 1 ] || nb=1
backend=("${cpus[@]:0:nb}"); load=("${cpus[@]:nb}")
{ nproc; lscpu | grep -E "Model name|Thread|Core|Socket"; echo "router cpu 1 (siblings $sib), backends ${backend[*]}, load ${load[*]}"
  python3 -c "import aiohttp, orjson, httptools, uvloop; print('aiohttp', aiohttp.__version__, 'orjson', orjson.__version__)"
  vllm-router --version 2>&1 | head -1; } | tee "$out/host.txt"
python3 "$code/benchmarks/router/bench_router.py" --arms pdserve vllm-router --api chat messages responses \
  --clients 1 64 --duration "$dur" --runs "$runs" --proxy-core 1 --load-cores "${load[@]}" \
  --backend-cores "${backend[@]}" --out "$out/bench-router-host.json" > "$out/bench-router-host.txt" 2> "$out/cells.txt"
rc=$?
cat "$out/bench-router-host.txt"; tail -5 "$out/cells.txt"
exit $rc
