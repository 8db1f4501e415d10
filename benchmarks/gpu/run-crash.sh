#!/bin/bash
# Issue 33 on one H200, configs/gpu-1p1d-shared.yaml as shipped (only the model replaced by mkcfg.py's
# random-weight 8B-class one): a crash costs no request, the canary proves both directions, the "on" turn
# in parts. Wheel parts already in /tmp/parts. Results under $OUT; the cluster stays up between calls.
#   benchmarks/gpu/run-crash.sh up        install, the plan's transport lines, up (its canary), doctor
#   benchmarks/gpu/run-crash.sh split     the streamed 36k on/off turn in parts, 5 times (measure.py split),
#                                      and the off/on curve at 2k-4k around the 2048 threshold
#   benchmarks/gpu/run-crash.sh faults    while a client sends a short chat every 0.25 s: SIGKILL decode-0,
#                                      wait for `running`, then prefill-0 (faults.py on the running cluster;
#                                      FAULTS_KILL=decode-0 kills only that one)
#   benchmarks/gpu/run-crash.sh variant NAME K=V...   down, up again with these env settings on both servers
#                                      (e.g. UCX_CUDA_IPC_CACHE=y; extra:K=V sets a kv_connector_extra_config
#                                      key), split at 36k twice
source "$(dirname "$0")/env.sh"
name=${CRASH_NAME:-crash}
cfg=/tmp/$name.yaml
router=http://127.0.0.1:8000 p=http://127.0.0.1:8100 d=http://127.0.0.1:8200
logs() {
  mkdir -p /tmp/logs && for f in "$PDSERVE_HOME"/clusters/*/logs/*.log; do
    [ -f "$f" ] && tail -n 3000 "$f" > "/tmp/logs/$(basename "$(dirname "$(dirname "$f")")")-$(basename "$f")"; done
  tar czf "$out/logs-$1.tgz" -C /tmp logs
}
split36() {
  python3 "$code/benchmarks/gpu/measure.py" split $router $p "$out/split-$1.json" 36864 "$2" $d | tee "$out/split-$1.txt"
}
case $1 in
  up)
    python3 "$code/benchmarks/gpu/cluster.py" "$cfg" "$name" --shared > "$out/$name.yaml"
    pd plan "$cfg" | grep "set by pdserve" | sort -u
    pd_up "$name" "$cfg"
    pd logs "$name" supervisor -n 200 | grep -a "canary" | tail -2
    pd doctor "$cfg" 2>&1 | tee "$out/doctor.txt"
    logs up ;;
  split)
    split36 shipped 5
    python3 "$code/benchmarks/gpu/measure.py" curve $router $p "$out/threshold.json" 2048,3072,4096 | tee "$out/threshold.txt"
    nvidia-smi --query-gpu=memory.used --format=csv
    logs split ;;
  faults)
    FAULTS_ATTACH=1 FAULTS_KEEP=1 FAULTS_KILL=${FAULTS_KILL:-decode-0,prefill-0} timeout 560 \
      python3 "$code/benchmarks/gpu/faults.py" "$cfg" "$out" 200 | cut -c1-1500
    for role in prefill-0 decode-0; do      # what each survivor dropped of its dead peer's mappings
      pd logs "$name" "$role" -n 20000 2>/dev/null | grep -a "pdserve-ipc-sweep" | tail -3; done
    logs faults ;;
  variant)
    shift; variant=$1; shift
    pd down "$name"; nvidia-smi --query-gpu=memory.used --format=csv
    envs=(); for kv in "$@"; do case $kv in extra:*) envs+=(--extra "${kv#extra:}") ;; *) envs+=(--env "$kv") ;; esac; done
    python3 "$code/benchmarks/gpu/cluster.py" "$cfg" "$name" --shared "${envs[@]}" > "$out/$name-$variant.yaml"
    pd_up "$name" "$cfg"
    split36 "$variant" 2
    logs "$variant" ;;
  down)
    pd down "$name"; nvidia-smi --query-gpu=memory.used --format=csv ;;
esac
