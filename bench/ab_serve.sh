#!/usr/bin/env bash
# Back-to-back A/B of `nori bench compare` (colocated and disaggregated) between an earlier
# commit and this checkout: the serving check a change to the step, scheduler or serving path
# owes.
#
# Usage: bench/ab_serve.sh COMMIT ROUNDS OUT_DIR [bench compare options...]
#   e.g. bench/ab_serve.sh 19a793e 3 /tmp/ab-serve
# Default load (options given replace it): the demo model, random 128/128 as token ids, 64
# prompts at concurrency 16, ignore_eos, 16 warm-ups.
#
# The sides take turns (before, after, after, before, ...) ROUNDS times; each JSON report is
# kept in OUT_DIR; the medians and their ratios are printed last. The earlier commit runs from a
# git worktree in /tmp laid out by scripts/source_tree.py, with its own torch-extension folder.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
commit=$1 rounds=$2 out=$3
shift 3
load=("$@")
if [ ${#load[@]} -eq 0 ]; then
  load=(--model demo --dataset random --random-input-len 128 --random-output-len 128
    --random-range-ratio 0 --prompt-format token-ids --num-prompts 64 --max-concurrency 16
    --ignore-eos --num-warmups 16)
fi
before=/tmp/nori-ab-$commit
[ -d "$before" ] || git -C "$root" worktree add --detach "$before" "$commit" >/dev/null
python="$root/.venv/bin/python"
"$python" "$before/scripts/source_tree.py" "$before-tree" >/dev/null
mkdir -p "$out"
# Build the earlier commit's C++ kernels now, not inside the first timed cluster's start.
PYTHONPATH="$before-tree" TORCH_EXTENSIONS_DIR="$before-ext" "$python" -c \
  'from nori.kernels.cpu_build import cpu_kernels; assert cpu_kernels() is not None'

run() {  # run SIDE ROUND
  local tree=() sides=()
  [ "$1" = before ] && tree=(env "PYTHONPATH=$before-tree" "TORCH_EXTENSIONS_DIR=$before-ext")
  # Colocated and disaggregated only, where the commit's bench compare has more sides.
  local source="$root"
  [ "$1" = before ] && source="$before"
  grep -q -- '"--sides"' "$source/shared/cli/cluster_bench.py" &&
    sides=(--sides colocated,disaggregated)
  "${tree[@]}" "$python" -m nori.cli.main bench compare "${load[@]}" "${sides[@]}" --repeats 1 --json \
    2>/dev/null >"$out/$1-$2.json"
  "$python" -c 'import json, sys
d = json.load(open(sys.argv[1]))
line = "{} {:.0f} tok/s (ITL p99 {:.1f} ms)"
sides = [line.format(s, d[s]["output_throughput"], d[s]["p99_itl_ms"]) for s in ("colocated", "disaggregated")]
print(sys.argv[2], ", ".join(sides))' \
    "$out/$1-$2.json" "round $2 $1:"
}

for round in $(seq "$rounds"); do
  if ((round % 2)); then sides=(before after); else sides=(after before); fi
  for side in "${sides[@]}"; do run "$side" "$round"; done
done
"$python" - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
for s in ("colocated", "disaggregated"):
    med = {
        side: statistics.median(
            json.load(open(f"{out}/{side}-{r}.json"))[s]["output_throughput"] for r in range(1, n + 1)
        )
        for side in ("before", "after")
    }
    print(f"{s}: before {med['before']:.0f}, after {med['after']:.0f} tok/s = {med['after'] / med['before']:.2f}x")
PY
