#!/usr/bin/env bash
# The project's GPU check, for a machine with one NVIDIA GPU and no package registry.
# Runs from source (no install): kernel tests on the GPU, engine tests on the GPU (Triton kernels
# in the loop, compared with transformers), kernel benchmarks, and the offline engine benchmark on
# Llama-3-8B and Llama-3.2-1B shapes with random weights. Writes everything under $OUT.
# `bench/gpu_check.sh tests` runs only the probe of the 8-bit KV store and both test suites, every
# failure listed (about 3 minutes once the machine is up).
# `bench/gpu_check.sh perf` (issue 50; run it first on a lent device; every step at its time
# limit makes 9.8 minutes): the host ms per decode step and each step against its floor on this
# card (tiny, 1B and 8B shapes at batch 64 and 256; the 8B with decode CUDA graphs and with
# --enforce-eager), the step profile (phase ms, top ops by host and device time), offline
# throughput on 1,024 prompts of 128/128 at the default KV pool (1B and 8B), the engine tests.
set -uo pipefail
MODE="${1:-all}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/nori-gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(python3 scripts/source_tree.py /tmp/nori-src):$PWD"
nori() { python3 -m nori.cli.main "$@"; }

step() {  # step NAME TIMEOUT_S COMMAND...: one check; a failure does not stop the others
  local name=$1 limit=$2
  shift 2
  echo "=== $name" | tee -a "$OUT/summary.txt"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 4 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
  echo "--- $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/summary.txt"

if [ "$MODE" = perf ]; then
  nori model init /tmp/llama3-8b --preset llama3-8b --no-weights >/dev/null
  nori model init /tmp/llama3-1b --preset llama3-1b --no-weights >/dev/null
  step step_overhead_tiny 30 python3 -m nori.cli.main bench step-overhead --steps 20 --json
  step step_overhead_1b 75 python3 -m nori.cli.main bench step-overhead \
    --model /tmp/llama3-1b --load-format dummy --batch-sizes 64,256 --steps 20 --json
  for graphs in on off; do
    flags=()
    [ "$graphs" = off ] && flags=(--enforce-eager)
    step "step_overhead_8b_graphs_$graphs" 90 python3 -m nori.cli.main bench step-overhead \
      --model /tmp/llama3-8b --load-format dummy --batch-sizes 64,256 --steps 20 --json \
      "${flags[@]}"
  done
  step step_profile_8b 45 python3 bench/profile_steps.py /tmp/llama3-8b --load-format dummy \
    --num-requests 64 --prompt-len 128
  for shape in 1b 8b; do
    step "offline_$shape" 90 python3 -m nori.cli.main bench offline --model "/tmp/llama3-$shape" \
      --load-format dummy --num-prompts 1024 --input-len-range 128:128 \
      --output-len-range 128:128 --json
  done
  # Graphs on (every CUDA engine captures its own): the graph and fidelity tests first.
  step engine_tests 75 python3 -m pytest -q -p no:cacheprovider -rf --tb=line \
    tests/engine/test_decode_graphs.py tests/engine/test_overlapped_steps.py tests/engine/test_fidelity.py \
    tests/kernels/test_decode_attention.py tests/kernels/test_layer_ops_triton.py tests/engine
  grep -h '^{' "$OUT"/step_overhead_*.log "$OUT"/offline_*.log >"$OUT/perf.jsonl" || true
  exit 0
fi
if [ "$MODE" = tests ]; then
  step kv_quant_probe 60 python3 bench/kv_quant_gpu_probe.py
  cat "$OUT/kv_quant_probe.log"
  step kernel_tests 200 python3 -m pytest -q -p no:cacheprovider -rf --tb=line tests/kernels
  step engine_tests 200 python3 -m pytest -q -p no:cacheprovider -rf --tb=line tests/engine
  grep -h '^FAILED\|^/.*Error' "$OUT"/*_tests.log | head -40
  exit 0
fi
step kernel_tests 150 python3 -m pytest -q -p no:cacheprovider -x tests/kernels
nori model init /tmp/llama3-8b --preset llama3-8b --no-weights >/dev/null
# A 4 GiB KV pool (2048 blocks of 16 tokens at 128 KiB per token): what a 24 GB card holds next
# to 16 GB of 8B weights. Continuous and static batching share it, and max_num_seqs 256.
step bench_8b 240 python3 -m nori.cli.main bench offline --model /tmp/llama3-8b --load-format dummy \
  --num-prompts 128 --input-len-range 32:512 --output-len-range 16:512 --compare-static --json \
  --num-kv-blocks 2048
# Issue 12: the same 8B shape with 8-bit weights (the Triton weight-only kernel), decode-bound.
for quant in none int8 fp8; do
  flags=()
  [ "$quant" != none ] && flags=(--quantization "$quant")
  step "bench_8b_weights_$quant" 180 python3 -m nori.cli.main bench offline \
    --model /tmp/llama3-8b --load-format dummy --num-prompts 64 --input-len-range 128:128 \
    --output-len-range 128:128 --max-num-seqs 64 --json --num-kv-blocks 2048 "${flags[@]}"
done
# Issue 12: the 8-bit KV cache (Triton store and attention over int8/fp8 codes), same shape.
for kv in int8 fp8; do
  step "bench_8b_kv_$kv" 150 python3 -m nori.cli.main bench offline \
    --model /tmp/llama3-8b --load-format dummy --num-prompts 64 --input-len-range 128:128 \
    --output-len-range 128:128 --max-num-seqs 64 --json --num-kv-blocks 2048 --kv-cache-dtype "$kv"
done
step engine_tests 150 python3 -m pytest -q -p no:cacheprovider tests/engine
step kernel_bench 60 python3 bench/kernels_gpu.py
grep -h '^{' "$OUT"/bench_*.log >"$OUT/bench.jsonl" || true
