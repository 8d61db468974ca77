#!/usr/bin/env bash
# Issue 12's levers, each alone and stacked, with `nori bench offline`: decode-bound runs at
# batch 1 and batch 16 on one model, the configurations taking turns ROUNDS times (so a slow
# spell of a shared machine hits them all); the median of the rounds and its ratio to float32
# are printed last, per batch size.
#
# Usage: bench/levers.sh ROUNDS [MODEL] [bench offline options...]
#   e.g. bench/levers.sh 3 small
# Writes nothing; prints one line per run and a table at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds=$1 model=${2:-small}
shift $(($# >= 2 ? 2 : 1))
python="$root/.venv/bin/python"

declare -A levers=(
  [float32]=""
  [bf16]="--dtype bfloat16"
  [int8]="--quantization int8"
  [int8+bf16]="--quantization int8 --dtype bfloat16"
)
order=(float32 bf16 int8 int8+bf16)
# Batch 1: 4 requests one after another; batch 16: 32 requests, 16 at a time. 128 prompt and
# 128 output tokens each, so decode steps dominate.
declare -A batches=(
  [1]="--max-num-seqs 1 --num-prompts 4"
  [16]="--max-num-seqs 16 --num-prompts 32"
)

results=$(mktemp)
for round in $(seq "$rounds"); do
  for batch in 1 16; do
    for lever in "${order[@]}"; do
      # shellcheck disable=SC2086  # the option strings are word lists on purpose
      tok_s=$("$python" -m nori.cli.main bench offline --json --model "$model" \
        --input-len-range 128:128 --output-len-range 128:128 \
        ${batches[$batch]} ${levers[$lever]} "$@" 2>/dev/null |
        "$python" -c 'import json, sys; print(json.load(sys.stdin)["continuous_output_tok_s"])')
      echo "round $round batch $batch $lever: $tok_s output tok/s"
      echo "$batch $lever $tok_s" >>"$results"
    done
  done
done
"$python" - "$results" "${order[@]}" <<'EOF'
import statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    batch, lever, tok_s = line.split()
    runs[(int(batch), lever)].append(float(tok_s))
print(f"{'batch':>5} {'lever':>10} {'median tok/s':>13} {'vs float32':>10}  runs")
for batch in (1, 16):
    base = statistics.median(runs[(batch, "float32")])
    for lever in sys.argv[2:]:
        median = statistics.median(runs[(batch, lever)])
        shown = ", ".join(f"{x:.0f}" for x in runs[(batch, lever)])
        print(f"{batch:>5} {lever:>10} {median:>13.1f} {median / base:>9.2f}x  {shown}")
EOF
rm -f "$results"
