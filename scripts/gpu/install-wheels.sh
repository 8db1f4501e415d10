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
rm -rf "$w"
echo "installed $(ls "$target" | grep -c dist-info) distributions into $target"
