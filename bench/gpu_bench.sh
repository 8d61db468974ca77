#!/usr/bin/env bash
# The offline benchmark alone on a GPU machine, from source: bench/gpu_bench.sh PRESET KV_BLOCKS
# Random weights of the preset's shape (--load-format dummy), 128 prompts, inputs 32-512 and
# outputs 16-512 tokens, continuous vs static batching on one KV pool of KV_BLOCKS x 16 tokens.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
preset=${1:-llama3-1b}
blocks=${2:-2048}
OUT="${OUT:-/tmp/nori-gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(python3 scripts/source_tree.py /tmp/nori-src):$PWD"
python3 -m nori.cli.main model init "/tmp/$preset" --preset "$preset" --no-weights >/dev/null
python3 -m nori.cli.main bench offline --model "/tmp/$preset" --load-format dummy \
  --num-prompts 128 --input-len-range 32:512 --output-len-range 16:512 --compare-static --json \
  --num-kv-blocks "$blocks" 2>&1 | tee "$OUT/bench_$preset.log"
