#!/usr/bin/env bash
# The README's serving benchmarks (docs/benchmark-results.md), one per name; each writes JSON (and plots) under OUT_DIR.
#
# Usage: bench/serving_suite.sh NAME OUT_DIR
#   latency   small model, colocated, prefill budget auto, random 512/128 at concurrency 16:
#             3 runs on one cluster
#   compare   nori bench compare on the mixed workload (small model): colocated, disaggregated
#             and conditional (--disaggregation auto), 3 alternating runs a side
#   sweep     the same comparison over request rates of the short requests
#   conditional  issue 28's sweep: the small model, 1 prefill + 1 decode, 80% short prompts
#             (32-128 tokens) and 20% long ones (1000-2000) on one arrival process, at each of
#             CONDITIONAL_RATES (default 1,2,4,8 req/s, both classes), 15 s a run, 3 alternating
#             runs a side of colocated, disaggregated and conditional; CONDITIONAL_ARGS adds
#             bench compare options (e.g. --max-local-compute-s 1)
#   burst     64 prompts of 500-2000 tokens at once, 1 prefill + 2 decode workers (demo): 3 runs
#   prefix    the prefix dataset with and without prefix caching, 3 alternating runs
#   pinning   disaggregated mixed load (small model) with and without CPU pinning, alternating
#   tracing   demo, disaggregated, random 128/128 at concurrency 16, tracing off and on (spans
#             to a local OTLP/gRPC receiver, bench/otlp_sink.py), 3 alternating runs a side
#   real      SmolLM2-135M-Instruct (a real model), colocated, random 128/128: 64 prompts at
#             concurrency 16, then the batch regime (256 at 64); REAL_WORKER_ARGS picks the type
#             (e.g. '--dtype bfloat16', '--dtype bfloat16 --quantization int8'): 3 runs each
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
name=$1 out=$2
mkdir -p "$out"
nori=("$root/.venv/bin/python" -m nori.cli.main)
port=8123

up() {  # up LOG up-options...: starts `nori up` in the background; waits until it serves
  local log=$1
  shift
  setsid "${nori[@]}" up --port "$port" "$@" >"$log" 2>&1 &
  for _ in $(seq 120); do
    grep -q "serving '" "$log" && return 0
    sleep 1
  done
  echo "the cluster did not start; see $log" >&2
  return 1
}

down() {
  pkill -INT -f "nori.cli.main up --port $port" || true
  while pgrep -f "nori.cli.main up --port $port" >/dev/null; do sleep 0.5; done
}
trap down EXIT

serve() {  # serve RESULT bench-serve-options...
  local result=$1
  shift
  "${nori[@]}" bench serve --base-url "http://127.0.0.1:$port" --result-file "$result" "$@" \
    >/dev/null 2>&1
}

mixed=(--dataset mixed --random-input-len 128 --random-output-len 128 --long-input-len 1500
  --long-output-len 16 --long-request-rate 0.5 --prompt-format token-ids --ignore-eos
  --slo-ttft-ms 2000 --slo-tpot-ms 50)

# Issue 28's load: 20% of the arrivals are long prompts (--long-fraction), so the rate scales both.
conditional=(--dataset mixed --random-input-len 80 --random-range-ratio 0.6 --random-output-len 64
  --long-fraction 0.2 --long-input-len 1500 --long-range-ratio 0.333 --long-output-len 16
  --prompt-format token-ids --ignore-eos --slo-ttft-ms 2000 --slo-tpot-ms 50)

case $name in
latency)
  # The latency setting (the cap), unless LATENCY_WORKER_ARGS says otherwise: e.g.
  # '--prefill-budget-with-decodes 0' for the uncapped trade-off (the serving default).
  up "$out/cluster.log" --model small --colocated \
    --worker-args="${LATENCY_WORKER_ARGS:---prefill-budget-with-decodes auto}"
  for run in 1 2 3; do
    # A seed per run: the same prompts again would hit the prefix cache of the run before.
    serve "$out/run-$run.json" --seed "$run" --dataset random --random-input-len 512 --random-output-len 128 \
      --random-range-ratio 0 --prompt-format token-ids --num-prompts 64 --max-concurrency 16 \
      --ignore-eos --num-warmups 16 --plot "$out/run-$run.png"
  done
  ;;
compare)
  "${nori[@]}" bench compare --model small "${mixed[@]}" --max-concurrency 8 --duration 40 \
    --num-warmups 8 --repeats 3 --json --plot "$out/compare.png" --log-dir "$out/logs" \
    >"$out/compare.json"
  ;;
sweep)
  "${nori[@]}" bench compare --model small "${mixed[@]}" --duration 15 --num-warmups 8 \
    --repeats 3 --sweep 1,2,4,8 --json --plot "$out/sweep.png" --log-dir "$out/logs" \
    >"$out/sweep.json"
  ;;
conditional)
  "${nori[@]}" bench compare --model small --prefill 1 --decode 1 "${conditional[@]}" \
    --duration 15 --num-warmups 8 --repeats 3 --sweep "${CONDITIONAL_RATES:-1,2,4,8}" \
    ${CONDITIONAL_ARGS:-} \
    --sides colocated,disaggregated,conditional --json --plot "$out/conditional.png" \
    --log-dir "$out/logs" >"$out/conditional.json"
  ;;
burst)
  # The gateway's default admission bound (429 up front), then none (every request queues).
  for run in 1 2 3; do
    for side in bounded unbounded; do
      flags=()
      [ "$side" = unbounded ] && flags=(--max-queued-prompt-tokens 0)
      up "$out/cluster-$side-$run.log" --model demo --prefill 1 --decode 2 "${flags[@]}"
      serve "$out/$side-$run.json" --dataset random --random-input-len 1250 \
        --random-range-ratio 0.6 --random-output-len 32 --prompt-format token-ids \
        --num-prompts 64 --ignore-eos --request-timeout-s 300 --save-detailed
      down
    done
  done
  ;;
prefix)
  for run in 1 2 3; do
    for side in cached uncached; do
      flags=()
      [ "$side" = uncached ] && flags=(--worker-args=--no-prefix-caching)
      up "$out/cluster-$side-$run.log" --model small --prefill 1 --decode 1 "${flags[@]}"
      serve "$out/$side-$run.json" --dataset prefix --prefix-num-groups 4 --prefix-len 1024 \
        --suffix-len 32 --prefix-output-len 32 --prompt-format token-ids --num-prompts 48 \
        --request-rate 2 --ignore-eos --num-warmups 0
      down
    done
  done
  ;;
pinning)
  for run in 1 2 3; do
    for side in pinned unpinned; do
      flags=()
      [ "$side" = unpinned ] && flags=(--no-cpu-pinning)
      up "$out/cluster-$side-$run.log" --model small "${flags[@]}"
      serve "$out/$side-$run.json" "${mixed[@]}" --max-concurrency 8 --duration 40 \
        --num-warmups 8
      down
    done
  done
  ;;
tracing)
  sink_port=4319
  for run in 1 2 3; do
    for side in off on; do
      flags=()
      if [ "$side" = on ]; then
        "$root/.venv/bin/python" -m nori.bench.otlp_sink --port "$sink_port" \
          --out "$out/spans-$run.json" &
        sink=$!
        flags=(--otlp-traces-endpoint "http://127.0.0.1:$sink_port")
      fi
      up "$out/cluster-$side-$run.log" --model demo "${flags[@]}"
      serve "$out/$side-$run.json" --seed "$run" --dataset random --random-input-len 128 \
        --random-output-len 128 --random-range-ratio 0 --prompt-format token-ids \
        --num-prompts 64 --max-concurrency 16 --ignore-eos --num-warmups 16
      down
      if [ "$side" = on ]; then
        kill -INT "$sink" && wait "$sink" || true
      fi
    done
  done
  ;;
real)
  up "$out/cluster.log" --model smollm2-135m-instruct --colocated \
    --worker-args="${REAL_WORKER_ARGS:-}"
  for run in 1 2 3; do
    serve "$out/interactive-$run.json" --seed "$run" --dataset random --random-input-len 128 \
      --random-output-len 128 --random-range-ratio 0 --prompt-format token-ids --num-prompts 64 \
      --max-concurrency 16 --ignore-eos --num-warmups 16
    serve "$out/batch-$run.json" --seed "$((run + 10))" --dataset random --random-input-len 128 \
      --random-output-len 128 --random-range-ratio 0 --prompt-format token-ids --num-prompts 256 \
      --max-concurrency 64 --ignore-eos --num-warmups 16
  done
  ;;
*)
  echo "unknown benchmark $name" >&2
  exit 2
  ;;
esac
