#!/bin/bash
# One H200, configs/gpu-1p1d-shared.yaml as shipped (only the model replaced by mkcfg.py's random-weight
# 8B-class one): 24 conversations growing to ~32k tokens, 4 at a time, with the held-KV budget (as shipped)
# and with D's fixed timer (`timer` arm: router.held_kv off), issue 32. Wheel parts already in /tmp/parts.
#   benchmarks/gpu/run-held.sh up      install, up (the cluster stays up while the machine is warm)
#   benchmarks/gpu/run-held.sh on      bench --attach on the shipped cluster, its held-KV status lines
#   benchmarks/gpu/run-held.sh timer   down, then bench --arms timer (the same servers, router.held_kv off)
# A turn with no whole answer in 30 s fails and its conversation ends there (--give-up-after 1): a stalled D
# costs one timeout per conversation.
source "$(dirname "$0")/env.sh"
cfg=/tmp/held.yaml
bench=(--workload "$code/benchmarks/gpu/workload-24x32k.json" --concurrency 4 --stream --request-timeout 30
       --give-up-after 1)
case $1 in
  up)
    python3 "$code/benchmarks/gpu/cluster.py" "$cfg" held --shared > "$out/held.yaml"
    pd_up held "$cfg"
    pd logs held decode-0 -n 400 | grep -a "pdserve-entry\|pdserve-held" | tail -3 ;;
  on)
    t0=$(date +%s)
    pd bench "$cfg" --attach held "${bench[@]}" --out /tmp/held-on > "$out/held-on.txt" 2>&1
    echo "bench: $(( $(date +%s) - t0 )) s"; tail -30 "$out/held-on.txt"
    cp /tmp/held-on/results.json "$out/held-on.json"
    pd status held | tee "$out/held-on-status.txt" | grep -ai "held\|reuse\|turns" ;;
  timer)
    pd down held; t0=$(date +%s)
    pd bench "$cfg" --arms timer "${bench[@]}" --out /tmp/held-timer > "$out/held-timer.txt" 2>&1
    echo "bench: $(( $(date +%s) - t0 )) s"; tail -30 "$out/held-timer.txt"
    cp /tmp/held-timer/results.json "$out/held-timer.json"
    nvidia-smi --query-gpu=memory.used --format=csv ;;
esac
