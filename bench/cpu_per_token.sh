#!/usr/bin/env bash
# CPU time per output token of each serving process, read from /proc/PID/stat around one run.
#
# Usage: bench/cpu_per_token.sh OUT_DIR [nori up options...]   (default: --colocated --model demo)
#
# Starts `nori up` with the options, warms it with 16 prompts, then runs `nori bench serve`
# (random 128/128 as token ids, 256 prompts at concurrency 16, ignore_eos) while reading the
# utime + stime of the gateway, every worker (and its engine process, with --engine-core
# process) and the client; prints each one's CPU seconds and
# milliseconds per output token, and writes them to OUT_DIR/cpu_per_token.json.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=$1
shift
up_args=("$@")
[ ${#up_args[@]} -eq 0 ] && up_args=(--colocated --model demo)
mkdir -p "$out"
python="$root/.venv/bin/python"
port=8126
setsid "$python" -m nori.cli.main up --port "$port" "${up_args[@]}" >"$out/up.log" 2>&1 &
trap 'pkill -INT -f "nori.cli.main up --port $port" || true' EXIT
for _ in $(seq 300); do grep -q "serving '" "$out/up.log" && break; sleep 1; done
serve() {
  "$python" -m nori.cli.main bench serve --base-url "http://127.0.0.1:$port" --seed "$1" \
    --dataset random --random-input-len 128 --random-output-len 128 --random-range-ratio 0 \
    --prompt-format token-ids --num-prompts "$2" --max-concurrency 16 --ignore-eos \
    --result-file "$out/serve-$1.json" >/dev/null 2>&1
}
serve 0 16
"$python" - "$out" "$port" <<'PY'
import json, os, subprocess, sys, time
out, port = sys.argv[1], sys.argv[2]
tick = os.sysconf("SC_CLK_TCK")

def roles() -> dict[str, int]:
    found = {}
    listing = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        pid, _, args = line.strip().partition(" ")
        if "nori.cli.main serve" not in args and "-m nori serve" not in args:
            continue
        words = args.split()
        role = words[words.index("serve") + 1]
        name = words[words.index("--worker-id") + 1] if "--worker-id" in words else role
        found[name] = int(pid)
        # --engine-core process: the worker's engine process, counted apart (its I/O side is
        # what is left under the worker's own name).
        children = f"/proc/{pid}/task/{pid}/children"
        for child in open(children).read().split() if os.path.exists(children) else ():
            if b"spawn_main" in open(f"/proc/{child}/cmdline", "rb").read():
                found[f"{name}/engine"] = int(child)
    return found

def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick

pids = roles()
before = {name: cpu_s(pid) for name, pid in pids.items()}
started = time.monotonic()
client = subprocess.Popen([
    sys.executable, "-m", "nori.cli.main", "bench", "serve", "--base-url",
    f"http://127.0.0.1:{port}", "--seed", "1", "--dataset", "random",
    "--random-input-len", "128", "--random-output-len", "128", "--random-range-ratio", "0",
    "--prompt-format", "token-ids", "--num-prompts", "256", "--max-concurrency", "16",
    "--ignore-eos", "--result-file", f"{out}/serve-1.json",
], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
_, status, usage = os.wait4(client.pid, 0)
wall = time.monotonic() - started
after = {name: cpu_s(pid) for name, pid in pids.items()}
result = json.load(open(f"{out}/serve-1.json"))
tokens = result["total_output_tokens"] if "total_output_tokens" in result else result["output_throughput"] * result["duration"]
rows = {name: after[name] - before[name] for name in pids}
rows["client"] = usage.ru_utime + usage.ru_stime
report = {
    "output_tokens": tokens, "wall_s": wall, "output_tok_s": result["output_throughput"],
    "cpu_s": rows, "ms_per_token": {name: 1000 * s / tokens for name, s in rows.items()},
}
json.dump(report, open(f"{out}/cpu_per_token.json", "w"), indent=2)
print(f"{tokens:.0f} output tokens in {wall:.1f} s ({result['output_throughput']:.0f} tok/s)")
for name, seconds in rows.items():
    print(f"  {name:14s} {seconds:6.2f} CPU s  {1000 * seconds / tokens:.3f} ms/token")
PY
