#!/bin/bash
# One H200 (P and D sharing GPU 0), configs/gpu-1p1d-shared.yaml as shipped: only the model is replaced by
# the random-weight 8B-class one of mkcfg.py (no model hub there); cost guard, transport and vLLM flags as
# shipped. Wheel parts already moved to /tmp/parts (scripts/gpu/wheelhouse.sh). Results under $OUT.
#   benchmarks/gpu/run-shipped.sh curve   install, up, plan's transport lines, doctor, off/on curve 2k-32k
#                                      streamed and not (measure.py), status; the cluster stays up
#   benchmarks/gpu/run-shipped.sh load    8 conversations of 10 turns to ~32k tokens, 4 at a time: `bench
#                                      --attach` on the running shipped cluster, down, then the `off` arm
source "$(dirname "$0")/env.sh"
cfg=/tmp/shipped.yaml
case $1 in
  curve)
    python3 "$code/benchmarks/gpu/cluster.py" "$cfg" shipped --shared > "$out/shipped.yaml"
    pd plan "$cfg" | grep "set by pdserve" | sort -u
    pd_up shipped "$cfg"
    pd doctor "$cfg" 2>&1 | tee "$out/doctor.txt"
    python3 "$code/benchmarks/gpu/measure.py" curve http://127.0.0.1:8000 http://127.0.0.1:8100 "$out/curve.json" \
      2048,4096,8192,16384,24576,32768
    pd status shipped | tee "$out/status.txt" ;;
  load)
    pd bench "$cfg" --attach shipped --workload "$code/benchmarks/gpu/workload-32k.json" --concurrency 4 \
      --out /tmp/load-on > "$out/load-on.txt" 2>&1; tail -25 "$out/load-on.txt"
    cp /tmp/load-on/results.json "$out/load-on.json"
    pd status shipped | tail -4; pd down shipped; nvidia-smi --query-gpu=memory.used --format=csv
    pd bench "$cfg" --arms off --workload "$code/benchmarks/gpu/workload-32k.json" --concurrency 4 \
      --out /tmp/load-off > "$out/load-off.txt" 2>&1; tail -25 "$out/load-off.txt"
    cp /tmp/load-off/results.json "$out/load-off.json"
    nvidia-smi --query-gpu=memory.used --format=csv ;;
esac
