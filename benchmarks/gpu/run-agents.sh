#!/bin/bash
# One H200, configs/gpu-1p1d-shared.yaml as shipped (only the model replaced by mkcfg.py's random-weight
# 8B-class one): off/on TTFT of a streamed agent step per wire format (chat, Anthropic Messages, OpenAI
# Responses) at 16k and 32k tokens (issue 31). Wheel parts already moved to /tmp/parts.
#   benchmarks/gpu/run-agents.sh up        install, up (the cluster stays up while the machine is warm)
#   benchmarks/gpu/run-agents.sh measure   measure_apis.py, status, the servers' pdserve-entry lines
source "$(dirname "$0")/env.sh"
cfg=/tmp/agents.yaml
case $1 in
  up)
    python3 "$code/benchmarks/gpu/cluster.py" "$cfg" agents --shared > "$out/agents.yaml"
    pd_up agents "$cfg" ;;
  measure)
    (cd "$code/benchmarks/gpu" && python3 measure_apis.py http://127.0.0.1:8000 http://127.0.0.1:8100 \
      "$out/apis.json" 16384,32768) | tee "$out/apis.txt"
    pd status agents | tee "$out/status.txt"
    pd logs agents prefill-0 -n 400 | grep -a "pdserve-entry" | tail -2 ;;
esac
