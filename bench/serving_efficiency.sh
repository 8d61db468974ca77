#!/usr/bin/env bash
# Served against offline throughput on the same load, measured in alternating rounds.
#
# Usage: bench/serving_efficiency.sh ROUNDS OUT_DIR [--model demo]
#
# Each round runs `nori bench offline` (demo, 64 x 128/128, --max-num-seqs 16, one run) and then
# `nori bench compare` on the same load through the gateway (random 128/128 as token ids, 64
# prompts at concurrency 16, ignore_eos; one colocated and one disaggregated run). The medians of
# the rounds and the served/offline ratios are printed last; each round's JSON stays in OUT_DIR.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds=$1 out=$2
shift 2
model=(--model demo)
[ $# -gt 0 ] && model=("$@")
python="$root/.venv/bin/python"
mkdir -p "$out"
for round in $(seq "$rounds"); do
  "$python" -m nori.cli.main bench offline "${model[@]}" --num-prompts 64 \
    --input-len-range 128:128 --output-len-range 128:128 --max-num-seqs 16 --repeats 1 --json \
    2>/dev/null >"$out/offline-$round.json"
  "$python" -m nori.cli.main bench compare "${model[@]}" --sides colocated,disaggregated \
    --dataset random --random-input-len 128 --random-output-len 128 --random-range-ratio 0 \
    --prompt-format token-ids --num-prompts 64 --max-concurrency 16 --ignore-eos \
    --num-warmups 16 --repeats 1 --json 2>/dev/null >"$out/served-$round.json"
  "$python" - "$out" "$round" <<'EOF'
import json, sys
out, r = sys.argv[1], sys.argv[2]
offline = json.load(open(f"{out}/offline-{r}.json"))["continuous_output_tok_s"]
served = json.load(open(f"{out}/served-{r}.json"))
c, d = (served[s]["output_throughput"] for s in ("colocated", "disaggregated"))
print(f"round {r}: offline {offline:.0f}, colocated {c:.0f}, disaggregated {d:.0f} output tok/s")
EOF
done
"$python" - "$out" "$rounds" <<'EOF'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
offline = [json.load(open(f"{out}/offline-{r}.json"))["continuous_output_tok_s"] for r in range(1, n + 1)]
served = [json.load(open(f"{out}/served-{r}.json")) for r in range(1, n + 1)]
o = statistics.median(offline)
summary = {"offline_output_tok_s": o}
for side in ("colocated", "disaggregated"):
    m = statistics.median(s[side]["output_throughput"] for s in served)
    summary[f"{side}_output_tok_s"] = m
    summary[f"{side}_over_offline"] = m / o
    print(f"{side}: median {m:.0f} output tok/s = {m / o:.2f}x offline (median {o:.0f})")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
EOF
