#!/bin/bash
# Decode-crash runs on GPUs through pdserve itself (issue 12.3, 12.4): install the offline wheelhouse (parts
# already moved to /tmp/parts), build the random-weight 8B-class model, then per STEP a cluster variant and
# benchmarks/gpu/faults.py (up, load, reuse, SIGKILL of D's API server, recovery, reuse, down). Results in $OUT.
#   benchmarks/gpu/run-faults.sh STEP...   STEP = two-gpu (P GPU 0, D GPU 1) | shared (P and D on GPU 0)
# FAULTS_VLLM_ARG (default --enforce-eager: no torch.compile/CUDA graphs, so a start takes ~1 min, not ~4, on
# a fresh machine) is added to both servers; set it to e.g. --seed=0 for the shipped behaviour.
# FAULTS_BUDGET_S (default 570): a step is skipped when fewer than 250 s of it are left.
source "$(dirname "$0")/env.sh"
mkdir -p "$out"
cd "$code" || exit 1    # `python -m` puts the working directory first on sys.path: this tree's pdserve wins
arg=${FAULTS_VLLM_ARG:---enforce-eager}
budget=${FAULTS_BUDGET_S:-570}
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
rc=0
for step in "$@"; do
  left=$(( budget - SECONDS ))
  if [ "$left" -lt 250 ]; then echo "skipped $step: ${left} s left"; continue; fi
  case $step in
    two-gpu) name=f2; python3 benchmarks/gpu/cluster.py "/tmp/$name.yaml" "$name" "--arg=$arg" > "$out/$name.yaml" ;;
    shared)  name=f1; python3 benchmarks/gpu/cluster.py "/tmp/$name.yaml" "$name" --shared "--arg=$arg" > "$out/$name.yaml" ;;
    *) echo "unknown step $step"; continue ;;
  esac
  echo "== $step ($name), ${left} s left"
  timeout $(( left - 10 )) python3 benchmarks/gpu/faults.py "/tmp/$name.yaml" "$out" $(( left - 150 )) || rc=1
  python3 -m pdserve down "$name" >/dev/null 2>&1    # after a timeout: leave nothing for the next step
done
# the servers' and supervisor's logs, their last 4000 lines each
mkdir -p /tmp/logs && for f in "$PDSERVE_HOME"/clusters/*/logs/*.log; do
  [ -f "$f" ] && tail -n 4000 "$f" > "/tmp/logs/$(basename "$(dirname "$(dirname "$f")")")-$(basename "$f")"; done
tar czf "$out/logs.tgz" -C /tmp logs
exit $rc
