#!/usr/bin/env bash
# A new user's first start, timed: a fresh clone of this checkout, empty caches (HOME,
# TORCH_EXTENSIONS_DIR, NORI_CACHE_DIR), the README's main command, then the README's first
# request until it answers with text. Prints each line of the start with the seconds since the
# clone began, then the phases' times. Run it twice for a cold and a second cold start; WARM=1
# keeps the clone and caches of the run before (the warm start: `nori up` to first answer).
#
# Usage: bench/first_start.sh [PORT]      (default port 8765; work folder /tmp/nori-first-start)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
port=${1:-8765}
work=/tmp/nori-first-start
if [ "${WARM:-0}" != 1 ]; then
  rm -rf "$work"
  mkdir -p "$work/home" "$work/extensions" "$work/cache"
fi
export HOME="$work/home" TORCH_EXTENSIONS_DIR="$work/extensions" NORI_CACHE_DIR="$work/cache"
started=${EPOCHREALTIME/./}
elapsed() {
  local us=$((${EPOCHREALTIME/./} - started))
  printf '%4d.%d' $((us / 1000000)) $((us % 1000000 / 100000))
}
if [ "${WARM:-0}" != 1 ]; then
  git clone -q "$root" "$work/nori"
  # The clone has what is committed; the README's shared/ folder sits beside it, as in CI.
  ln -sfn "$(cd "$root/.." && pwd)/shared" "$work/shared"
  echo "$(elapsed) s  git clone done"
fi
cd "$work/nori"
log="$work/up.log"
(scripts/nori up --port "$port" 2>&1 | while IFS= read -r line; do echo "$(elapsed) s  $line"; done >"$log") &
up=$!
body='{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}'
answer=""
for _ in $(seq 600); do
  if grep -q "serving '" "$log" 2>/dev/null; then
    answer=$(curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d "$body" || true)
    [ -n "$answer" ] && break
  fi
  if grep -q "nori: error" "$log" 2>/dev/null; then break; fi
  sleep 0.5
done
done_at=$(elapsed)
pkill -INT -f "nori up --port $port" || true
# Until the cluster has stopped: a run straight after would start beside its exit.
wait "$up" || true
cat "$log"
echo "$done_at s  first answer: $answer"
echo "total: $done_at s from $( [ "${WARM:-0}" = 1 ] && echo '`nori up`' || echo 'git clone') to the first answer"
