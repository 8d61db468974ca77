#!/usr/bin/env bash
# Issue 12's levers through the gateway: `nori bench compare` (colocated and disaggregated, same
# CPUs) on one model with each lever passed to the workers, the levers taking turns ROUNDS
# times; the medians of the rounds and their ratios to float32 are printed last.
#
# Usage: bench/levers_serve.sh ROUNDS OUT_DIR [MODEL] [weights|kv]
#   e.g. bench/levers_serve.sh 3 /tmp/levers-serve small
#        bench/levers_serve.sh 3 /tmp/levers-serve-kv small kv
# Load (weights): random 128/128 as token ids, 64 prompts at concurrency 16, ignore_eos, 16
# warm-ups. kv: every worker's KV pool capped at 32 MiB (2048 float32 tokens of the 24M preset)
# and 128 prompts at concurrency 64, so the pool, not the client, sets the batch size.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds=$1 out=$2 model=${3:-small} suite=${4:-weights}
python="$root/.venv/bin/python"
mkdir -p "$out"
declare -A levers
case "$suite" in
  weights)
    levers=(
      [float32]=""
      [bf16]="--dtype bfloat16"
      [int8]="--quantization int8"
      [int8+bf16]="--quantization int8 --dtype bfloat16"
    )
    order=(float32 bf16 int8 int8+bf16)
    pool="" load=(--num-prompts 64 --max-concurrency 16 --num-warmups 16)
    ;;
  kv)
    levers=(
      [float32]=""
      [int8-kv]="--kv-cache-dtype int8"
      [bf16]="--dtype bfloat16"
      [bf16+int8-kv]="--dtype bfloat16 --kv-cache-dtype int8"
      [all]="--quantization int8 --dtype bfloat16 --kv-cache-dtype int8"
    )
    order=(float32 int8-kv bf16 bf16+int8-kv all)
    pool="--cpu-kv-cache-gib 0.03125 --max-num-seqs 64"
    load=(--num-prompts 128 --max-concurrency 64 --num-warmups 16)
    ;;
  *)
    echo "unknown suite $suite (weights or kv)" >&2
    exit 2
    ;;
esac
for round in $(seq "$rounds"); do
  for lever in "${order[@]}"; do
    "$python" -m nori.cli.main bench compare --model "$model" --sides colocated,disaggregated \
      --worker-args "${levers[$lever]} $pool" \
      --dataset random --random-input-len 128 --random-output-len 128 --random-range-ratio 0 \
      --prompt-format token-ids "${load[@]}" --ignore-eos \
      --repeats 1 --json 2>/dev/null >"$out/$lever-$round.json"
    "$python" -c 'import json, sys
d = json.load(open(sys.argv[1]))
sides = ", ".join(s + " " + format(d[s]["output_throughput"], ".0f") for s in ("colocated", "disaggregated"))
print(sys.argv[2], sides, "output tok/s")' "$out/$lever-$round.json" "round $round $lever:"
  done
done
"$python" - "$out" "$rounds" "${order[@]}" <<'PY'
import json, statistics, sys
out, n, order = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print(f"{'lever':>13} {'colocated':>10} {'ratio':>6} {'disaggregated':>14} {'ratio':>6}")
base = {}
for lever in order:
    runs = [json.load(open(f"{out}/{lever}-{r}.json")) for r in range(1, n + 1)]
    med = {s: statistics.median(x[s]["output_throughput"] for x in runs) for s in ("colocated", "disaggregated")}
    base = base or med
    print(f"{lever:>13} {med['colocated']:>10.0f} {med['colocated'] / base['colocated']:>5.2f}x "
          f"{med['disaggregated']:>14.0f} {med['disaggregated'] / base['disaggregated']:>5.2f}x")
PY
