# Sourced by the run-*.sh scripts on the GPU node: the offline install (wheel parts already moved to
# /tmp/parts, scripts/gpu/wheelhouse.sh), the random-weight 8B-class model, and pdserve from this checkout.
set -u
code=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-/tmp/out}
export PDSERVE_HOME=/tmp/pdhome NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
[ -d /tmp/site/vllm ] || bash "$code/scripts/gpu/install-wheels.sh" /tmp/parts /tmp/site || exit 1
# Wheels carried loose beside the parts (one a wheelhouse made before they were listed lacks, e.g. orjson).
for w in /tmp/parts/*.whl; do
  [ -f "$w" ] && [ ! -f "$w.installed" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site "$w" \
    && touch "$w.installed"
done
export PYTHONPATH=/tmp/site:$code
[ -f /tmp/pdserve-model/config.json ] || python3 "$code/benchmarks/gpu/mkcfg.py" /tmp/pdserve-model >/dev/null || exit 1
pd() { python3 -m pdserve "$@"; }
# pd_up NAME CONFIG: `pdserve up`, its output in $out/up-NAME.txt and the time it took; on failure the
# servers' last log lines, and the calling script exits 1.
pd_up() {
  local t0; t0=$(date +%s)
  if ! pd up "$2" > "$out/up-$1.txt" 2>&1; then
    cat "$out/up-$1.txt"; pd logs "$1" prefill-0 -n 60; pd logs "$1" decode-0 -n 60; exit 1
  fi
  echo "up $1: $(( $(date +%s) - t0 )) s"; tail -3 "$out/up-$1.txt"
}
