#!/bin/bash
# One GPU run through pdserve itself (2 H200): install the offline wheelhouse (parts already moved to
# /tmp/parts), build the random-weight 8B-class model, then for each STEP: `pdserve up` of a variant of
# configs/gpu-1p1d.yaml, a measurement (benchmarks/gpu/measure.py), `pdserve down`. Results under $OUT.
#   benchmarks/gpu/run-pd.sh STEP...   STEP = curve | curve-b64 | guard   (see below)
source "$(dirname "$0")/env.sh"
up() {   # NAME, cluster.py options
  local name=$1; shift
  python3 "$code/benchmarks/gpu/cluster.py" "/tmp/$name.yaml" "$name" "$@" > "$out/$name.yaml"
  local t0=$(date +%s)
  pd up "/tmp/$name.yaml" || { pd logs "$name" prefill-0 2>&1 | tail -40; pd logs "$name" decode-0 2>&1 | tail -40; return 1; }
  echo "up $name: $(( $(date +%s) - t0 )) s"
  pd status "$name"
  grep -h "pdserve-entry" "$PDSERVE_HOME"/clusters/"$name"/logs/*.log 2>/dev/null | sort -u
}
down() { pd doctor "/tmp/$1.yaml" > "$out/$1-doctor.txt" 2>&1; pd status "$1"; pd down "$1"; nvidia-smi --query-gpu=memory.used --format=csv; }
for step in "$@"; do
  case $step in
    curve)      # (a) the on/off TTFT curve, streamed and not, vLLM's default block size (16)
      up pd2 --block 16 --no-cost-aware && python3 "$code/benchmarks/gpu/measure.py" curve http://127.0.0.1:8000 http://127.0.0.1:8100 "$out/curve.json"; down pd2 ;;
    curve-b64)  # (c) the same with 64-token KV blocks (the shipped config): 4x fewer NIXL descriptors per pull
      up pd2b --no-cost-aware && python3 "$code/benchmarks/gpu/measure.py" curve http://127.0.0.1:8000 http://127.0.0.1:8100 "$out/curve-b64.json" 8192,16384,24576,32768; down pd2b ;;
    guard)      # (b) cost guard with UCX forced onto TCP: reuse must cost no more than 1.1x recompute
      up pd2g --cost-aware --env UCX_TLS=tcp,cuda_copy && python3 "$code/benchmarks/gpu/measure.py" guard http://127.0.0.1:8000 http://127.0.0.1:8100 "$out/guard.json" 16384 10; down pd2g ;;
  esac
done
