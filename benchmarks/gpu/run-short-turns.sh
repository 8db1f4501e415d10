#!/bin/bash
# Short turns on D alone on one H200 (issue 19): configs/gpu-1p1d-shared.yaml as shipped (only the model is
# the random-weight 8B-class one of mkcfg.py), `pdserve bench --arms on,local --stream`, with short user
# turns between long tool results up to ~30k tokens. Wheel parts already moved to /tmp/parts.
#   [ARMS=on,local CONVS=2 USER_WORDS=8 RUN=suffix] benchmarks/gpu/run-short-turns.sh start
#                                          install, then the bench in the background (it outlives the call
#                                          while the machine is kept warm); prints its progress for a while
#   benchmarks/gpu/run-short-turns.sh wait    wait for it (at most WAIT_S, default 560 s), copy results to $OUT
source "$(dirname "$0")/env.sh"
export NO_COLOR=1
cfg=/tmp/short.yaml
log=/tmp/short-bench.log
wait_s=${WAIT_S:-560}
case $1 in
  start)
    python3 "$code/benchmarks/gpu/cluster.py" "$cfg" short --shared > "$out/short.yaml"
    # ~4.4 tokens a word with mkcfg's 1024-token vocabulary: turn 1 ~13k tokens, turn 8 ~31k.
    setsid nohup python3 -m pdserve bench "$cfg" --arms ${ARMS:-on,local} --stream --conversations ${CONVS:-2} --turns 8 \
      --system-words 3000 --tool-words 1000 --user-words ${USER_WORDS:-8} --out /tmp/short-out${RUN:-} > "$log" 2>&1 < /dev/null &
    echo $! > /tmp/short-bench.pid
    wait_s=${WAIT_S:-500} ;&
  wait)
    pid=$(cat /tmp/short-bench.pid)
    t0=$(date +%s)
    while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$wait_s" ]; do sleep 5; done
    tail -c 6000 "$log"
    cp "$log" "$out/" 2>/dev/null
    cp /tmp/short-out${RUN:-}/results.json /tmp/short-out${RUN:-}/results.csv "$out/" 2>/dev/null
    if kill -0 "$pid" 2>/dev/null; then echo "bench still running"; else echo "bench finished"; fi
    nvidia-smi --query-gpu=memory.used --format=csv ;;
esac
