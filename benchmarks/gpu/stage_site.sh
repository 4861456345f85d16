#!/usr/bin/env bash
# stage_site.sh LIST OUTDIR TARGET [WHEEL...] : the wheel set installed here into one site folder for the host's
# Python 3.12, trimmed of what an H200 run never loads, and sent as three xz parts instead of seven wheel parts.
# Fewer parts, fewer calls to lose when a host goes back between two of them.
set -euo pipefail
list=$1 out=$2 target=$3; shift 3
name=$(basename "$out") work=$(mktemp -d)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/wheels" -r "$list"
python3 -m pip install -q --no-index --no-deps --no-compile --ignore-requires-python "${plat[@]}" --target "$work/site" "$work"/wheels/*.whl "$@"
# Never loaded on an H200 running bf16 models: FlashAttention-2 (vLLM takes FA3 on Hopper), the Blackwell-only
# fmha kernels, the vendored DeepGEMM (fp8), and Ray's Java jars.
rm -rf "$work/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$work/site/vllm/third_party/fmha_sm100" \
       "$work/site/vllm/third_party/deep_gemm" "$work/site/ray/jars"
tar cf - -C "$work" site | xz -T0 -6 > "$work/site.tar.xz"
bash "$(dirname "$0")/split_parts.sh" "$work/site.tar.xz" "$out" "rm -rf $target && mkdir -p $target
cat part* | xz -d -T0 | tar xf - -C $target --strip-components=1
echo \"unpacked \$(ls $target | wc -l) entries into $target\""
rm -rf "$work"
