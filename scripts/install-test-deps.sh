#!/usr/bin/env bash
# Debian packages the tests use: sshd in network namespaces (openssh-server, iproute2) and a one-node
# Slurm (slurm-wlm, munge) for tests/multihost; redis-server for the shared reuse store (openssl: the TLS
# test's certificate); prometheus for the scrape-config and dashboard tests; Node (nodejs, npm) for the real
# coding agents; gcc and binutils (as, objcopy, nm) for tests/unit/test_ipc_sweep.py (a stub CUDA driver, and
# engine/ipc_drop.py's machine code assembled again). Then the pinned agents themselves from npm
# (@anthropic-ai/claude-code, @openai/codex) into .test-agents/ (git-ignored; PDSERVE_TEST_AGENTS elsewhere),
# which tests/e2e/test_real_coding_agents.py runs. Idempotent: installs only what is missing, Debian packages
# only as root on apt systems; elsewhere the tests that need them skip with the reason (test_ipc_sweep.py's
# fail: without a compiler it cannot check the sweeper against UCX at all).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
want=()
command -v ip >/dev/null || want+=(iproute2)
[ -x /usr/sbin/sshd ] || want+=(openssh-server)
command -v ssh >/dev/null || want+=(openssh-client)
command -v slurmctld >/dev/null && command -v slurmd >/dev/null || want+=(slurm-wlm)
command -v munged >/dev/null || [ -x /usr/sbin/munged ] || want+=(munge)
command -v redis-server >/dev/null || want+=(redis-server)
command -v openssl >/dev/null || want+=(openssl)
command -v prometheus >/dev/null || want+=(prometheus)
command -v node >/dev/null || want+=(nodejs)
command -v npm >/dev/null || want+=(npm)
command -v gcc >/dev/null || want+=(gcc)
command -v as >/dev/null && command -v objcopy >/dev/null && command -v nm >/dev/null || want+=(binutils)
if [ ${#want[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-test-deps: missing ${want[*]} (not root or no apt-get): the tests that need them will skip" >&2
  else
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
  fi
fi

# The real coding agents, exactly these versions (tests/kits/coding_agents.py names the same ones).
agents="${PDSERVE_TEST_AGENTS:-$here/.test-agents}"
pins=(@anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0)
if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  echo "install-test-deps: no node/npm: the real coding agents' test will skip" >&2
  exit 0
fi
have() {   # the installed version of package $1 in $agents, or nothing
  node -e 'try { console.log(require(process.argv[1]).version) } catch (e) {}' \
    "$agents/node_modules/$1/package.json" 2>/dev/null
}
missing=()
for pin in "${pins[@]}"; do
  [ "$(have "${pin%@*}")" = "${pin##*@}" ] || missing+=("$pin")
done
if [ ${#missing[@]} -gt 0 ]; then
  mkdir -p "$agents"
  npm install --prefix "$agents" --no-audit --no-fund --save-exact --loglevel=error "${pins[@]}" >/dev/null
fi
