#!/usr/bin/env bash
# Bundle the CUDA build of MLX (and optional FILEs) for the lent GPU machine, as chunks that fit the
# device tool's 64 MiB per call. Follows ../shared/device/README.md:
#   scripts/gpu/gpu_prepare.sh [FILE ...]      FILEs relative to the project root
# writes .w1/ .w2/ ... (git-ignored) and prints the run commands: each .wK but the last is sent as
#   mkdir -p /root/wh && cp .wK/chunk.* /root/wh/
# and the last (carry .wN and vendor/mlx-lm) as
#   . .wN/install-on-gpu.sh && python3 -m omlx_cache.bench ...
# SERVE=1 also bundles what the load benchmark through the server needs there (the openai client's
# wheels, SmolLM2's tokenizer files, the evaluation text), then:
#   python3 scripts/gpu/random_model.py --tokenizer models/SmolLM2-135M-Instruct --out /tmp/m &&
#   python3 -m omlx_cache loadbench --model /tmp/m --text wiki.test.raw --kv fp16 --kv 4 ... --out $OUT/l.json
set -euo pipefail
cd "$(dirname "$0")/../.."
mlx_version=$(sed -n 's/^mlx==//p' requirements.txt)
chunk_mb=${CHUNK_MB:-56}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bundle/wheels" "$work/bundle/files" vendor/.cache/gpu-wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d vendor/.cache/gpu-wheels "mlx==$mlx_version" "mlx-cuda-13==$mlx_version" 2>/dev/null
cp vendor/.cache/gpu-wheels/mlx-"$mlx_version"-*.whl vendor/.cache/gpu-wheels/mlx_cuda_13-"$mlx_version"-*.whl "$work/bundle/wheels/"
if [ "${SERVE:-0}" = 1 ]; then
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$work/bundle/wheels" openai 2>/dev/null
    text=${TEXT:-../shared/data/wikitext-2-raw/wiki.test.raw}
    cp "$text" "$work/bundle/files/wiki.test.raw"
    set -- "$@" models/SmolLM2-135M-Instruct/tokenizer.json \
        models/SmolLM2-135M-Instruct/tokenizer_config.json \
        models/SmolLM2-135M-Instruct/special_tokens_map.json
fi
for f in "$@"; do
    [ -f "$f" ] || { echo "gpu_prepare: no such file: $f" >&2; exit 1; }
    mkdir -p "$work/bundle/files/$(dirname "$f")"
    cp "$f" "$work/bundle/files/$f"
done
tar -C "$work/bundle" -cf "$work/bundle.tar" .
rm -rf .w[0-9]*
split -b "${chunk_mb}m" -d -a 2 "$work/bundle.tar" "$work/chunk."
n=0
for c in "$work"/chunk.*; do
    n=$((n + 1))
    mkdir -p ".w$n"
    mv "$c" ".w$n/"
done
cp ../shared/device/install-on-gpu.sh ".w$n/"
sha256sum "$work/bundle.tar" | cut -d' ' -f1 > ".w$n/BUNDLE_SHA256"
echo "gpu_prepare: $n chunk folder(s)"
for k in $(seq 1 $((n - 1))); do
    echo "  run $k (carry .w$k): mkdir -p /root/wh && cp .w$k/chunk.* /root/wh/"
done
echo "  run $n (carry .w$n vendor/mlx-lm): . .w$n/install-on-gpu.sh && python3 ..."
