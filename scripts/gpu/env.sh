# Sourced by the run-*.sh scripts on the GPU node: the offline install (wheel parts already moved to
# /tmp/parts, scripts/gpu/wheelhouse.sh), the random-weight 8B-class model, and pdserve from this checkout.
set -u
code=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-/tmp/out}
export PDSERVE_HOME=/tmp/pdhome NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
[ -d /tmp/site/vllm ] || bash "$code/scripts/gpu/install-wheels.sh" /tmp/parts /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$code
[ -f /tmp/pdserve-model/config.json ] || python3 "$code/scripts/gpu/mkcfg.py" /tmp/pdserve-model >/dev/null || exit 1
pd() { python3 -m pdserve "$@"; }
