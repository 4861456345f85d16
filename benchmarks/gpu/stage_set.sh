#!/usr/bin/env bash
# stage_set.sh LIST OUTDIR TARGET : like shared/gpu/stage.sh but installs into TARGET and keeps parts in /root/stage_<name>
set -euo pipefail
list=$1 out=$2 target=$3 name=$(basename "$out")
work=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$work/wheels" -r "$list"
tar cf "$work/wheels.tar" -C "$work" wheels
here=$(dirname "$0")
bash "$here/split_parts.sh" "$work/wheels.tar" "$out" "cat part* > wheels.tar && tar xf wheels.tar
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $target wheels/*.whl
echo \"installed \$(ls wheels | wc -l) wheels into $target\""
rm -rf "$work"
