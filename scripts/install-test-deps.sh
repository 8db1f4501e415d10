#!/usr/bin/env bash
# Debian packages the tests use: sshd in network namespaces (openssh-server, iproute2) and a one-node
# Slurm (slurm-wlm, munge) for tests/multihost; redis-server for the shared reuse store (openssl: the TLS
# test's certificate); prometheus for the scrape-config and dashboard tests. Idempotent: installs only what is missing, and only as root on apt
# systems; elsewhere those tests skip with the reason.
set -euo pipefail
want=()
command -v ip >/dev/null || want+=(iproute2)
[ -x /usr/sbin/sshd ] || want+=(openssh-server)
command -v ssh >/dev/null || want+=(openssh-client)
command -v slurmctld >/dev/null && command -v slurmd >/dev/null || want+=(slurm-wlm)
command -v munged >/dev/null || [ -x /usr/sbin/munged ] || want+=(munge)
command -v redis-server >/dev/null || want+=(redis-server)
command -v openssl >/dev/null || want+=(openssl)
command -v prometheus >/dev/null || want+=(prometheus)
if [ ${#want[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-test-deps: missing ${want[*]} (not root or no apt-get): multi-host tests will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
