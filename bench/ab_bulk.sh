#!/usr/bin/env bash
# Back-to-back A/B of how our transports move KV bytes between two processes of one host: the
# receiver copying them out of its mapping of the sender's shared memory (`--bulk mapped`) against
# messages (`--bulk messages`), on this checkout.
#
# Usage: bench/ab_bulk.sh ROUNDS OUT_DIR [bench transfer options...]
#   e.g. bench/ab_bulk.sh 3 /tmp/ab-bulk --block-kib 256 --destinations adjacent
#
# The sides take turns (messages, mapped, mapped, messages, ...) ROUNDS times over ucx,
# tcp_transport and the plain socket; each JSON report is kept in OUT_DIR; the medians per side
# are printed last.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds=$1 out=$2
shift 2
python="$root/.venv/bin/python"
mkdir -p "$out"
for round in $(seq "$rounds"); do
  if ((round % 2)); then sides=(messages mapped); else sides=(mapped messages); fi
  for side in "${sides[@]}"; do
    "$python" -m nori.cli.main bench transfer --json --transports ucx,tcp_transport,socket \
      --bulk "$side" "$@" >"$out/$side-$round.json"
    "$python" -c 'import json, sys
d = json.load(open(sys.argv[1]))
keys = ("ucx_gbps", "tcp_transport_gbps", "socket_gbps", "integrity_cost_vs_ucx")
print(sys.argv[2], ", ".join(f"{k} {d[k]}" for k in keys if k in d),
      "| bulk:", d["ucx_transports"].get("bulk"))' "$out/$side-$round.json" "round $round $side:"
  done
done
"$python" - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
keys = ("ucx_gbps", "tcp_transport_gbps", "socket_gbps", "ucx_vs_socket", "integrity_cost_vs_ucx")
for side in ("messages", "mapped"):
    runs = [json.load(open(f"{out}/{side}-{r}.json")) for r in range(1, n + 1)]
    medians = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
    print(f"{side}: medians of {n}:", medians)
PY
