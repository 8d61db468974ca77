#!/usr/bin/env bash
# Back-to-back A/B of `nori bench offline` between an earlier commit and this checkout.
#
# Usage: bench/ab_offline.sh COMMIT ROUNDS [bench offline options...]
#   e.g. bench/ab_offline.sh 86e922a 3 --num-prompts 64 --input-len-range 128:128 \
#        --output-len-range 128:128 --max-num-seqs 16
#
# The two trees take turns (before, after, after, before, ...) ROUNDS times, each run the median
# of `--repeats 3`, so a slow spell of a shared machine hits both sides; the medians of the
# rounds and their ratio are printed last. The earlier commit runs from a git worktree in
# /tmp, laid out by scripts/source_tree.py, with this checkout's virtual environment.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
commit=$1 rounds=$2
shift 2
before=/tmp/nori-ab-$commit
[ -d "$before" ] || git -C "$root" worktree add --detach "$before" "$commit" >/dev/null
python="$root/.venv/bin/python"
"$python" "$before/scripts/source_tree.py" "$before-tree" >/dev/null
# Build the earlier commit's C++ kernels now, not inside its first timed run.
PYTHONPATH="$before-tree" TORCH_EXTENSIONS_DIR="$before-ext" "$python" -c \
  'from nori.kernels.cpu_build import cpu_kernels; assert cpu_kernels() is not None'

run() {  # run SIDE: one median-of-3 offline run; prints its output tok/s
  local tree=()
  # Its own torch-extension folder: the C++ kernels differ, and one folder would rebuild them
  # at every switch of side.
  [ "$1" = before ] && tree=(env "PYTHONPATH=$before-tree" "TORCH_EXTENSIONS_DIR=$before-ext")
  "${tree[@]}" "$python" -m nori.cli.main bench offline --json --repeats 3 "${@:2}" 2>/dev/null |
    "$python" -c 'import json, sys; print(json.load(sys.stdin)["continuous_output_tok_s"])'
}

declare -a a b
for round in $(seq "$rounds"); do
  # Odd rounds run the earlier commit first, even rounds this checkout: a machine that slows
  # (or warms) from run to run favours neither side.
  if ((round % 2)); then
    a+=("$(run before "$@")")
    b+=("$(run after "$@")")
  else
    b+=("$(run after "$@")")
    a+=("$(run before "$@")")
  fi
  echo "round $round: before ${a[-1]} tok/s, after ${b[-1]} tok/s"
done
"$python" - "${#a[@]}" "${a[@]}" "${b[@]}" <<'EOF'
import statistics, sys
n = int(sys.argv[1])
before = [float(x) for x in sys.argv[2 : 2 + n]]
after = [float(x) for x in sys.argv[2 + n :]]
mb, ma = statistics.median(before), statistics.median(after)
print(f"median before {mb:.1f} tok/s, after {ma:.1f} tok/s, ratio {ma / mb:.2f}x")
EOF
