#!/bin/bash
# Issue 43 on one H200: configs/gpu-1p1d-agent-128k.yaml as shipped (128k context, P's prefix cache on, a 64 GiB
# CPU KV tier on P beside NIXL), only the model replaced by mkcfg.py's random-weight 8B-class one, under
# `pdserve bench --workload agentic` with benchmarks/gpu/agentic-128k.json (8 sessions past 100k tokens,
# sub-agent groups, published-shape gaps time-scaled). Wheel parts already in /tmp/parts; results under $OUT.
#   benchmarks/gpu/run-agentic.sh up            install, up (compiled, its canary), the connectors the servers built
#   benchmarks/gpu/run-agentic.sh on            the shipped config as it runs (bench --attach): D->P + P's caches
#   benchmarks/gpu/run-agentic.sh arm ARM [WL]  down, then bench's own up/down of arm ARM (prefix-cache: P's
#                                              cache + the CPU tier, no D->P; off: neither, P recomputes) on
#                                              workload WL (default agentic-128k.json)
#   benchmarks/gpu/run-agentic.sh finish STEP   a step's bench runs in the background: wait for it again
# WL=FILE picks another workload for `on` (agentic-128k-resumed.json: sessions resumed at 75-100k tokens, then
# turns of the published size; agentic-128k-resumed-off.json: its first session's first 8 turns, for `off`).
# Each step leaves $OUT/STEP.txt (bench's summary + the servers' tier/NIXL lines) and $OUT/STEP.tgz (results).
source "$(dirname "$0")/env.sh"
name=agent
cfg=/tmp/$name.yaml
wl=$code/benchmarks/gpu/agentic-128k.json
flags=(--stream --max-tokens 32 --concurrency 3 --request-timeout 120)
tiers() {   # the servers' connector lines: which connectors vLLM built, the tier's loads and stores
  for role in prefill-0 decode-0; do
    echo "== $role"
    pd logs "$1" "$role" -n 50000 2>/dev/null | grep -a -i -E "Creating v1 connector|offload|MultiConnector|max model len|rope|error" \
      | grep -v -i "warmup" | head -12 | cut -c1-300
  done
}
counters() {   # P's own counters: prompt tokens by source, the tier's bytes, NIXL's reads
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8100/metrics', timeout=10).read().decode())" | grep -a -E "^vllm:(prompt_tokens_by_source_total|kv_offload_(load|store)_bytes|nixl_xfer_time_seconds_count|nixl_num_failed)" | cut -c1-200
}
bench() {   # STEP, bench arguments: started in the background (a device call lasts 10 minutes at most), then
            # `finish STEP` waits for it
  local step=$1; shift
  local dir=/tmp/agentic-runs/$step
  rm -rf "$dir"; mkdir -p "$dir"
  date +%s > "$dir/t0"
  # its own session, so that it outlives the device call that started it (as pdserve's supervisor does)
  setsid bash -c 'python3 -m pdserve bench "$@" > "$0/bench.txt" 2>&1; echo $? > "$0/rc"' \
    "$dir" "$@" --workload "${WL:-$wl}" "${flags[@]}" --out "$dir/out" < /dev/null &
  finish "$step"
}
finish() {  # STEP: wait (up to WAIT_S, 540 s) for its bench; when done, its summary as $OUT/STEP.txt and its files
            # as $OUT/STEP.tgz; else say so (call `finish STEP` again)
  local step=$1 dir=/tmp/agentic-runs/$1 waited=0
  while [ ! -f "$dir/rc" ] && [ $waited -lt "${WAIT_S:-540}" ]; do sleep 5; waited=$((waited + 5)); done
  if [ ! -f "$dir/rc" ]; then echo "bench $step still running after $(( $(date +%s) - $(cat "$dir/t0") )) s"; tail -5 "$dir/bench.txt"; return 0; fi
  { echo "bench $step: rc $(cat "$dir/rc"), $(( $(date +%s) - $(cat "$dir/t0") )) s"; tail -c 6000 "$dir/bench.txt"; } > "$out/$step.txt"
  cat "$out/$step.txt"
  tar czf "$out/$step.tgz" -C /tmp/agentic-runs "$step"
}
case $1 in
  up)
    python3 "$code/benchmarks/gpu/cluster.py" "$cfg" "$name" --base gpu-1p1d-agent-128k.yaml > "$out/$name.yaml"
    pd plan "$cfg" | grep -E "kv-transfer-config|set by pdserve" | cut -c1-900 | sort -u
    free -g | head -2
    pd_up "$name" "$cfg"
    pd logs "$name" supervisor -n 200 | grep -a "canary" | tail -2
    tiers "$name"; counters
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv ;;
  on)
    bench on --attach "$name"
    counters; tiers "$name" | tail -8; pd status "$name" | tail -14
    for port in 8100 8200; do   # P's and D's whole /metrics after the run: queue, prefill and step histograms
      python3 -c "import urllib.request,sys; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())" \
        "http://127.0.0.1:$port/metrics" > "$out/on-metrics-$port.txt" 2>&1
    done ;;
  arm)
    arm=$2; [ -n "${3:-}" ] && WL=$code/benchmarks/gpu/$3
    pd down "$name" >/dev/null 2>&1
    # on a fresh machine (no `up` before): the config first
    [ -f "$cfg" ] || python3 "$code/benchmarks/gpu/cluster.py" "$cfg" "$name" --base gpu-1p1d-agent-128k.yaml > "$out/$name.yaml"
    bench "$arm" "$cfg" --arms "$arm" ;;
  finish)
    finish "$2"; [ -f "/tmp/agentic-runs/$2/rc" ] && [ "$2" = on ] && { counters; pd status "$name" | tail -14; } ;;
  down)
    pd down "$name"; nvidia-smi --query-gpu=memory.used --format=csv 2>/dev/null ;;
esac
