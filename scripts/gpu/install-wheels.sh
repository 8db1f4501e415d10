#!/bin/bash
# On the GPU node: join the wheelhouse parts (scripts/gpu/wheelhouse.sh) from PARTS_DIR and install them,
# offline, into TARGET (then: export PYTHONPATH=TARGET). --no-deps: the list is complete for the image.
#   scripts/gpu/install-wheels.sh PARTS_DIR [TARGET]
set -eu
parts=$1
target=${2:-/tmp/site}
w=$(mktemp -d)
cat "$parts"/part* | tar x -C "$w"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" "$w"/*.whl
# The big wheels' trees (wheelhouse.sh): what pip would have unpacked, dist-info included.
for t in "$w"/*.tree.tar.xz; do
  [ -f "$t" ] || continue
  if command -v xz >/dev/null; then tar xJf "$t" -C "$target"
  else python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$t" "$target"; fi
done
rm -rf "$w"
echo "installed $(ls "$target" | grep -c dist-info) distributions into $target"
