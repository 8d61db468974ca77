#!/usr/bin/env bash
# Back-to-back A/B of `nori bench transfer` between an earlier commit and this checkout: the
# check a change to the KV transfer owes.
#
# Usage: bench/ab_transfer.sh COMMIT ROUNDS OUT_DIR [bench transfer options...]
#   e.g. bench/ab_transfer.sh 5023e3d 3 /tmp/ab-transfer --block-kib 32 --destinations scattered
#
# The sides take turns (before, after, after, before, ...) ROUNDS times; each JSON report is
# kept in OUT_DIR; the medians of UCX's figures per side, and their ratio, are printed last. The
# earlier commit runs from a git worktree in /tmp laid out by scripts/source_tree.py.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
commit=$1 rounds=$2 out=$3
shift 3
before=/tmp/nori-ab-$commit
[ -d "$before" ] || git -C "$root" worktree add --detach "$before" "$commit" >/dev/null
python="$root/.venv/bin/python"
"$python" "$before/scripts/source_tree.py" "$before-tree" >/dev/null
mkdir -p "$out"

for round in $(seq "$rounds"); do
  if ((round % 2)); then sides=(before after); else sides=(after before); fi
  for side in "${sides[@]}"; do
    tree=()
    [ "$side" = before ] && tree=(env "PYTHONPATH=$before-tree")
    "${tree[@]}" "$python" -m nori.cli.main bench transfer --json "$@" >"$out/$side-$round.json"
    "$python" -c 'import json, sys
d = json.load(open(sys.argv[1]))
keys = ("ucx_gbps", "socket_gbps", "memcpy_gbps", "integrity_cost_vs_ucx")
print(sys.argv[2], ", ".join(f"{k} {d[k]}" for k in keys if k in d))' \
      "$out/$side-$round.json" "round $round $side:"
  done
done
"$python" - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
keys = ("ucx_gbps", "ucx_vs_socket", "ucx_vs_memcpy", "integrity_cost_vs_ucx")
for key in keys:
    med = {}
    for side in ("before", "after"):
        values = [json.load(open(f"{out}/{side}-{r}.json")).get(key) for r in range(1, n + 1)]
        if None not in values:
            med[side] = statistics.median(values)
    if len(med) == 2:
        print(f"{key}: before {med['before']:.3f}, after {med['after']:.3f}"
              f" = {med['after'] / med['before']:.2f}x")
PY
