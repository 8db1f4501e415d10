#!/bin/bash
# Offline wheelhouse for a GPU node that reaches no package index: download vLLM, NIXL (nixl + nixl-cu13) and
# what they import that the node's image lacks, for one Python/platform, into tar parts of at most 52 MiB
# (the device tool carries 64 MiB per call). Install there with scripts/gpu/install-wheels.sh.
# A wheel over 32 MiB travels as its unpacked tree in xz instead (NAME.tree.tar.xz): vLLM's 304 MB wheel is
# 214 MB so and NIXL's 59 MB is 32 MB, 6 parts instead of 8, so 2 device calls fewer a fresh machine.
#   scripts/gpu/wheelhouse.sh [WHEELS_TXT] [OUT_DIR] [PYTHON_VERSION]
# Defaults: scripts/gpu/wheels.txt (vLLM 0.26.0 + NIXL 1.5.1, CUDA 13, torch 2.11 already on the image),
# .gpu/ of this git checkout (ignored), Python 3.12.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
list=${1:-$here/wheels.txt}
top=$(git -C "$here" rev-parse --show-toplevel)
out=${2:-$top/.gpu}
py=${3:-3.12}
excl="$(git -C "$top" rev-parse --git-common-dir)/info/exclude"
grep -qx '/.gpu/' "$excl" 2>/dev/null || echo '/.gpu/' >> "$excl"
w=$(mktemp -d)
# manylinux tags are matched exactly by pip: name every glibc level the node's wheels may use.
plats=""
for t in 2_5 2_17 2_24 2_26 2_27 2_28 2_31 2_34 2_35; do plats="$plats --platform manylinux_${t}_x86_64"; done
pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 $plats -d "$w" -r "$list"
for f in "$w"/*.whl; do
  [ "$(stat -c %s "$f")" -gt $((32 << 20)) ] || continue
  d=$(mktemp -d); unzip -q "$f" -d "$d"
  tar cf - -C "$d" . | xz -6 -T0 > "${f%.whl}.tree.tar.xz"; rm -rf "$d" "$f"
done
rm -rf "$out" && mkdir -p "$out"
tar cf "$w/all.tar" -C "$w" --exclude all.tar .
split -b 52m -d "$w/all.tar" "$out/part"
(cd "$out" && sha256sum part* > SHA256SUMS)
rm -rf "$w"
ls -la "$out"
