#!/usr/bin/env bash
# Batch jobs against offline (issue 23): the same ShareGPT requests through
#   nori bench offline --batch-file      (the engine in-process, the ceiling)
#   nori run-batch --model demo --colocated          (gateway + one worker)
#   nori run-batch --model demo --prefill 1 --decode 1   (disaggregated)
# taking turns, ROUNDS times; prints the medians and the ratios to offline.
# Usage: bench/batch_throughput.sh [ROUNDS=3] [OUT=results/batch] [NUM_PROMPTS=1000]
#                                  [WORKER_ARGS, e.g. '--engine-core thread']
# MODEL (default demo) and ENGINE_ARGS (e.g. '--dtype bfloat16': the engine's, for offline and
# for every worker) from the environment.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds="${1:-3}"
out="${2:-results/batch}"
num="${3:-1000}"
worker_args="${4:-}"
model="${MODEL:-demo}"
read -r -a engine_args <<<"${ENGINE_ARGS:-}"
nori=(.venv/bin/python -m nori.cli.main)
mkdir -p "$out"
lscpu | grep -E "Model name|^CPU\(s\)|L3" > "$out/host.txt"
"${nori[@]}" bench batch-file --dataset-path ../shared/data/sharegpt/ShareGPT_V3_sample2000.json \
  -o "$out/requests.jsonl" --num-prompts "$num" --model "$model"
for round in $(seq 1 "$rounds"); do
  echo "round $round: offline" >&2
  "${nori[@]}" bench offline --batch-file "$out/requests.jsonl" --json --no-progress \
    --model "$model" "${engine_args[@]}" > "$out/offline-$round.json"
  for mode in colocated disaggregated; do
    echo "round $round: $mode" >&2
    flags=(--colocated)
    [ "$mode" = disaggregated ] && flags=(--prefill 1 --decode 1)
    rm -f "$out/$mode-$round.out.jsonl"
    "${nori[@]}" run-batch -i "$out/requests.jsonl" -o "$out/$mode-$round.out.jsonl" \
      --model "$model" "${flags[@]}" --worker-args "${ENGINE_ARGS:-} $worker_args" --summary-json "$out/$mode-$round.json" --no-progress \
      --log-dir "$out/logs-$mode-$round" 2> "$out/$mode-$round.log"
    rm -f "$out/$mode-$round.out.jsonl"
  done
done
.venv/bin/python - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
offline = [json.load(open(f"{out}/offline-{r}.json"))["continuous_output_tok_s"] for r in range(1, rounds + 1)]
print(f"offline output tok/s: {offline} median {statistics.median(offline)}")
for mode in ("colocated", "disaggregated"):
    runs = [json.load(open(f"{out}/{mode}-{r}.json")) for r in range(1, rounds + 1)]
    eff = [run["effective_output_tok_s"] for run in runs]
    ratios = [e / o for e, o in zip(eff, offline)]
    print(f"{mode}: effective {eff} median {statistics.median(eff)}; per-round ratio to offline "
          f"{[round(x, 3) for x in ratios]} median {statistics.median(ratios):.3f}; "
          f"failed {[run['failed'] for run in runs]}, retries {[run['retries'] for run in runs]}")
PY
