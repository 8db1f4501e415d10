#!/bin/bash
# Issue 44, items 1-2, on one H200: configs/gpu-1p1d-shared.yaml as shipped (only the model replaced by
# mkcfg.py's random-weight 8B-class one): the 36k "on" turn in parts and its bound, alone (median of 5,
# streamed) and under the 32k workload (8 conversations, 4 at a time, streamed), by on_turn_parts.py.
# Wheel parts already in /tmp/parts. Results under $OUT; the cluster stays up between calls.
#   benchmarks/gpu/run-parts.sh up              install, up (compiled, its canary), the servers' entry lines;
#                                               PARTS_ENV="K=V ..." sets env on both servers from the start,
#                                               PARTS_TOP="K=V ..." top-level keys (e.g. gpu_sharing=mps);
#                                               PARTS_ENV=PDSERVE_ENGINE_FORK=1: engine cores forked (the
#                                               servers' pdserve-fork lines say so, or vLLM's spawn warning)
#   benchmarks/gpu/run-parts.sh alone [TAG]     the on turn alone: each part, the bound, off/on
#   benchmarks/gpu/run-parts.sh load [TAG]      the workload through bench --attach, 5 36k probes during it
#   benchmarks/gpu/run-parts.sh all [TAG]       alone, then load, in one call (TAG names the step's files)
#   benchmarks/gpu/run-parts.sh loadoff [TAG]   down, then the same workload's `off` arm (bench's own up of
#                                               the same config, streamed): the off side of off/on under load
#   benchmarks/gpu/run-parts.sh variant NAME K=V...   down, up again with these env settings on both servers
#                                               (extra:K=V: a kv_connector_extra_config key, top:K=V a
#                                               top-level key, e.g. top:gpu_sharing=mps), then alone
#   benchmarks/gpu/run-parts.sh mps NAME [K=V...]   start an MPS control daemon (pipes under /tmp/mps), then as
#                                               variant with both servers as its clients: P and D share the
#                                               GPU's SMs at once instead of time-slicing it (issue 44 item 1);
#                                               from before pdserve's own daemon, which the shipped config now
#                                               runs: compare with `variant ts top:gpu_sharing=time_slice`
#   benchmarks/gpu/run-parts.sh mps-down        down, then stop the MPS daemon
# PARTS_ARGS adds on_turn_parts.py options (e.g. "--reps 3 --length 16384"); PARTS_ROUTER, PARTS_P, PARTS_D the
# URLs (default the shipped ports on 127.0.0.1), PARTS_NAME the cluster (parts), PARTS_WORKLOAD the workload.
# Each measuring STEP leaves $OUT/STEP.txt (the table) and $OUT/STEP.tgz (parts.json, the run's output, the
# bench's, and descs.txt: the servers' pdserve-entry lines and their NIXL reads' descriptor counts).
source "$(dirname "$0")/env.sh"
name=${PARTS_NAME:-parts}
cfg=/tmp/$name.yaml
router=${PARTS_ROUTER:-http://127.0.0.1:8000} p=${PARTS_P:-http://127.0.0.1:8100} d=${PARTS_D:-http://127.0.0.1:8200}
workload=${PARTS_WORKLOAD:-$code/benchmarks/gpu/workload-32k.json}
parts() {   # STEP, on_turn_parts.py options: STEP's files in /tmp/parts-runs/STEP, its table as $OUT/STEP.txt and
            # all of it as $OUT/STEP.tgz (the device brings back 8 files a call)
  local step=$1; shift
  local dir=/tmp/parts-runs/$step
  rm -rf "$dir"; mkdir -p "$dir"
  (cd "$code/benchmarks/gpu" && python3 on_turn_parts.py $router $p $d "$dir" "$@" ${PARTS_ARGS:-}) > "$dir/run.txt" 2>&1
  local rc=$?
  descs > "$dir/descs.txt"
  tail -c 5000 "$dir/run.txt"
  grep -c "pdserve-descs" "$dir/descs.txt"; grep -a "pdserve-descs" "$dir/descs.txt" | tail -4
  cp "$dir/parts.txt" "$out/$step.txt" 2>/dev/null
  tar czf "$out/$step.tgz" -C /tmp/parts-runs "$step"
  return $rc
}
descs() {   # the servers' entry lines and their last NIXL reads' descriptor counts
  for role in prefill-0 decode-0; do
    echo "== $role"
    pd logs "$name" "$role" -n 20000 2>/dev/null | grep -a "pdserve-entry\|pdserve-ipc-sweep\|pdserve-fork\|pdserve-shm\|must use the .spawn" | tail -6
    pd logs "$name" "$role" -n 20000 2>/dev/null | grep -a "pdserve-descs" | tail -12
  done
}
case $1 in
  up)
    envs=(); for kv in ${PARTS_ENV:-}; do envs+=(--env "$kv"); done
    for kv in ${PARTS_TOP:-}; do envs+=(--top "$kv"); done
    python3 "$code/benchmarks/gpu/cluster.py" "$cfg" "$name" --shared "${envs[@]}" > "$out/$name.yaml"
    pd plan "$cfg" | grep "set by pdserve" | sort -u
    pd_up "$name" "$cfg"
    pd logs "$name" supervisor -n 200 | grep -a "canary" | tail -2
    descs | cut -c1-400 ;;
  alone)
    parts "alone${2:+-$2}" ;;
  load)
    parts "load${2:+-$2}" --skip-alone --load-config "$cfg" --load-name "$name" --workload "$workload" --concurrency 4 ;;
  all)
    parts "all${2:+-$2}" --load-config "$cfg" --load-name "$name" --workload "$workload" --concurrency 4 ;;
  loadoff)
    pd down "$name"; nvidia-smi --query-gpu=memory.used --format=csv 2>/dev/null
    pd bench "$cfg" --arms off --workload "$workload" --concurrency 4 --stream --out "/tmp/loadoff${2:+-$2}" \
      > "$out/loadoff${2:+-$2}.txt" 2>&1; rc=$?
    tail -25 "$out/loadoff${2:+-$2}.txt"; cp "/tmp/loadoff${2:+-$2}/results.json" "$out/loadoff${2:+-$2}.json"
    exit $rc ;;
  variant)
    shift; variant=$1; shift
    pd down "$name"; nvidia-smi --query-gpu=memory.used --format=csv 2>/dev/null
    envs=(); for kv in "$@"; do case $kv in extra:*) envs+=(--extra "${kv#extra:}") ;;
      top:*) envs+=(--top "${kv#top:}") ;; *) envs+=(--env "$kv") ;; esac; done
    python3 "$code/benchmarks/gpu/cluster.py" "$cfg" "$name" --shared "${envs[@]}" > "$out/$name-$variant.yaml"
    pd_up "$name" "$cfg"
    parts "alone-$variant" ;;
  mps)
    shift; variant=$1; shift
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    command -v nvidia-cuda-mps-control || { echo "no nvidia-cuda-mps-control on this machine"; exit 1; }
    echo get_server_list | nvidia-cuda-mps-control 2>/dev/null || nvidia-cuda-mps-control -d
    "$0" variant "$variant" CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY \
      CUDA_MPS_LOG_DIRECTORY=$CUDA_MPS_LOG_DIRECTORY "$@"
    echo get_server_list | nvidia-cuda-mps-control; tail -5 "$CUDA_MPS_LOG_DIRECTORY/control.log" ;;
  mps-down)
    pd down "$name"
    echo quit | CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe nvidia-cuda-mps-control
    nvidia-smi --query-gpu=memory.used --format=csv 2>/dev/null ;;
  down)
    pd down "$name"; nvidia-smi --query-gpu=memory.used --format=csv 2>/dev/null ;;
esac
