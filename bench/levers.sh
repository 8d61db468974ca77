#!/usr/bin/env bash
# Issue 12's levers, each alone and stacked, with `nori bench offline`: the configurations take
# turns ROUNDS times (so a slow spell of a shared machine hits them all); the median of the
# rounds and its ratio to float32 are printed last, per workload.
#
# Usage: bench/levers.sh ROUNDS [MODEL] [--suite weights|kv] [bench offline options...]
#   e.g. bench/levers.sh 3 small              8-bit weights and bfloat16, decode at batch 1 and 16
#        bench/levers.sh 3 small --suite kv   the 8-bit KV cache at a fixed KV memory budget
# Writes nothing; prints one line per run and a table at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds=$1 model=${2:-small}
shift $(($# >= 2 ? 2 : 1))
suite=weights
if [[ ${1:-} == --suite ]]; then
  suite=$2
  shift 2
fi
python="$root/.venv/bin/python"

declare -A levers workloads
case "$suite" in
  weights)
    levers=(
      [float32]=""
      [bf16]="--dtype bfloat16"
      [int8]="--quantization int8"
      [int8+bf16]="--quantization int8 --dtype bfloat16"
    )
    order=(float32 bf16 int8 int8+bf16)
    # Batch 1: 4 requests one after another; batch 16: 32 requests, 16 at a time. 128 prompt
    # and 128 output tokens each, so decode steps dominate.
    workloads=(
      [1]="--max-num-seqs 1 --num-prompts 4"
      [16]="--max-num-seqs 16 --num-prompts 32"
    )
    workload_order=(1 16)
    ;;
  kv)
    levers=(
      [float32]=""
      [int8-kv]="--kv-cache-dtype int8"
      [fp8-kv]="--kv-cache-dtype fp8"
      [bf16]="--dtype bfloat16"
      [bf16+int8-kv]="--dtype bfloat16 --kv-cache-dtype int8"
      [all]="--quantization int8 --dtype bfloat16 --kv-cache-dtype int8"
    )
    order=(float32 int8-kv fp8-kv bf16 bf16+int8-kv all)
    # 64 requests of 128 + 128 tokens may all run at once, but a 32 MiB KV pool holds only
    # 2048 float32 tokens of the 24M preset (16 KiB each): the pool sets the batch size.
    workloads=([32MiB]="--max-num-seqs 64 --num-prompts 64 --cpu-kv-cache-gib 0.03125")
    workload_order=(32MiB)
    ;;
  *)
    echo "unknown suite $suite (weights or kv)" >&2
    exit 2
    ;;
esac

results=$(mktemp)
for round in $(seq "$rounds"); do
  for workload in "${workload_order[@]}"; do
    for lever in "${order[@]}"; do
      # shellcheck disable=SC2086  # the option strings are word lists on purpose
      read -r tok_s tokens < <("$python" -m nori.cli.main bench offline --json --model "$model" \
        --input-len-range 128:128 --output-len-range 128:128 \
        ${workloads[$workload]} ${levers[$lever]} "$@" 2>/dev/null |
        "$python" -c 'import json, sys; r = json.load(sys.stdin)
print(r["continuous_output_tok_s"], r["kv_cache_tokens"])')
      echo "round $round workload $workload $lever: $tok_s output tok/s, KV pool $tokens tokens"
      echo "$workload $lever $tok_s $tokens" >>"$results"
    done
  done
done
"$python" - "$results" "${order[@]}" <<'EOF'
import statistics, sys
from collections import defaultdict
runs, pools, workloads = defaultdict(list), {}, []
for line in open(sys.argv[1]):
    workload, lever, tok_s, tokens = line.split()
    runs[(workload, lever)].append(float(tok_s))
    pools[(workload, lever)] = int(tokens)
    if workload not in workloads:
        workloads.append(workload)
print(f"{'workload':>8} {'lever':>13} {'KV tokens':>9} {'median tok/s':>13} {'vs float32':>10}  runs")
for workload in workloads:
    base = statistics.median(runs[(workload, "float32")])
    for lever in sys.argv[2:]:
        median = statistics.median(runs[(workload, lever)])
        shown = ", ".join(f"{x:.0f}" for x in runs[(workload, lever)])
        print(
            f"{workload:>8} {lever:>13} {pools[(workload, lever)]:>9} {median:>13.1f} "
            f"{median / base:>9.2f}x  {shown}"
        )
EOF
rm -f "$results"
