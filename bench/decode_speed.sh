#!/usr/bin/env bash
# Decode-only speed of the weight levers on the 24M preset: `nori bench offline` twice per
# configuration, 128-token prompts with 128 output tokens and with 1, and the difference is the
# time of the 127 decode steps per request (prompt work is taken out, unlike bench/levers.sh).
#
# Usage: bench/decode_speed.sh ROUNDS     prints one line per configuration and round
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$root/.venv/bin/python"
seconds() {  # seconds OUTPUT_LEN MAX_NUM_SEQS NUM_PROMPTS [lever...]
  # shellcheck disable=SC2068  # the lever is a word list on purpose
  "$python" -m nori.cli.main bench offline --model small --input-len-range 128:128 \
    --output-len-range "$1:$1" --max-num-seqs "$2" --num-prompts "$3" --repeats 3 --json ${@:4} \
    2>/dev/null | "$python" -c 'import json, sys; print(json.load(sys.stdin)["continuous_seconds"])'
}
for round in $(seq "$1"); do
  for lever in "" "--quantization int8" "--dtype bfloat16"; do
    for workload in "16 32" "1 4"; do
      read -r batch prompts <<<"$workload"
      # shellcheck disable=SC2086
      full=$(seconds 128 "$batch" "$prompts" $lever)
      # shellcheck disable=SC2086
      prompt_only=$(seconds 1 "$batch" "$prompts" $lever)
      rate=$("$python" -c "print(round($prompts * 127 / ($full - $prompt_only), 1))")
      echo "round $round batch $batch [${lever:-float32}]: decode $rate tok/s" \
        "(full $full s, prompts only $prompt_only s)"
    done
  done
done
