#!/bin/bash
# Back-to-back: e194444 (before the step-cost fit) vs HEAD, latency load, seed per round.
cd /work/main
before=/tmp/nori-ab-e194444
[ -d $before ] || git worktree add --detach $before e194444 >/dev/null 2>&1
.venv/bin/python $before/scripts/source_tree.py $before-tree >/dev/null
out=/work/main/bench/results/serving/latency-ab; mkdir -p $out
for round in 1 2 3; do
  for side in before after; do
    env=(); [ $side = before ] && env=(env PYTHONPATH=$before-tree)
    "${env[@]}" setsid .venv/bin/python -m nori.cli.main up --port 8124 --model small --colocated > $out/cluster-$side-$round.log 2>&1 &
    for i in $(seq 120); do grep -q "serving '" $out/cluster-$side-$round.log && break; sleep 1; done
    .venv/bin/python -m nori.cli.main bench serve --base-url http://127.0.0.1:8124 --result-file $out/$side-$round.json --seed $round --dataset random --random-input-len 512 --random-output-len 128 --random-range-ratio 0 --prompt-format token-ids --num-prompts 64 --max-concurrency 16 --ignore-eos --num-warmups 16 >/dev/null 2>&1
    pkill -INT -f "nori.cli.main up --port 8124"; while pgrep -f "nori.cli.main up --port 8124" >/dev/null; do sleep 0.5; done
    python3 -c "
import json; d=json.load(open('$out/$side-$round.json'))
print('$round $side', round(d['output_throughput']), 'tpot', round(d['median_tpot_ms'],1), 'p99itl', round(d['p99_itl_ms'],1), 'ratio', round(d['p99_itl_ms']/d['median_tpot_ms'],2), 'ttft med', round(d['median_ttft_ms']), 'p99', round(d['p99_ttft_ms']), 'failed', d['failed'])"
  done
done
