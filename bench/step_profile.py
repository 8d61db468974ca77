"""Where an offline run's time goes, from a py-spy profile: the model's arithmetic against host work.

Usage:
    python bench/step_profile.py record OUT.txt -- [nori bench offline options...]
    python bench/step_profile.py summarize OUT.txt   (or OUT.txt.gz)

`record` runs `nori bench offline` (continuous batching, one run) under `py-spy record --format raw`
and then summarizes it; `summarize` reads such a file again. py-spy samples the Python stacks of the
main thread; native frames below a torch call count towards the Python frame that made it, so
"model forward" includes the matmuls and the C++ kernels it calls. Each sample lands in the first
bucket whose frame appears on its stack, read from the outermost frame inwards.
"""

from __future__ import annotations

import argparse
import gzip
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

# (bucket, pattern on one frame "function (file:line)"), checked from the stack's root outwards;
# the first frame that matches any pattern decides the bucket, so nested calls stay with their
# caller (the LM head inside execute is not "model forward").
BUCKETS: list[tuple[str, re.Pattern[str]]] = [
    ("inputs: StepInputs.build", re.compile(r"^(StepInputs\.)?build \(.*step_inputs\.py")),
    ("model forward (layers)", re.compile(r"^(\w+\.)?forward \(.*models/llama\.py")),
    ("lm head (compute_logits)", re.compile(r"^(\w+\.)?compute_logits \(")),
    ("sampling", re.compile(r"^(\w+\.)?sample \(.*model_runner\.py")),
    ("scheduler (schedule, update, step costs)", re.compile(r"\((.*scheduler|.*step_cost)\.py")),
    ("postprocess (stop checks, detokenize, outputs)", re.compile(r"^(\w+\.)?_postprocess \(")),
]
STEP = re.compile(r"^(\w+\.)?step \(.*engine/engine\.py")
OUTSIDE = "outside the step (benchmark loop, progress bar, setup)"
OTHER = "engine step, other"
HOST_BUCKETS = {name for name, _ in BUCKETS} - {
    "model forward (layers)",
    "lm head (compute_logits)",
}
HOST_BUCKETS.add(OTHER)


def bucket_of(frames: list[str]) -> str:
    in_step = False
    for frame in frames:
        if STEP.match(frame):
            in_step = True
            continue
        if not in_step:
            continue
        for name, pattern in BUCKETS:
            if pattern.search(frame):
                return name
    return OTHER if in_step else OUTSIDE


def summarize(path: Path) -> str:
    counts: Counter[str] = Counter()
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        # py-spy's raw format: the thread first, then frames root-first, ';'-separated.
        counts[bucket_of(stack.split(";"))] += int(count)
    in_step = sum(n for name, n in counts.items() if name != OUTSIDE)
    if in_step == 0:
        return "no samples inside LLMEngine.step"
    host = sum(counts[name] for name in HOST_BUCKETS)
    lines = [f"{'share of the engine step':<50} {'samples':>8} {'share':>7}"]
    for name in [*(name for name, _ in BUCKETS), OTHER]:
        lines.append(f"{name:<50} {counts[name]:>8} {counts[name] / in_step:>7.1%}")
    lines.append(
        f"{'host work (all but forward and lm head)':<50} {host:>8} {host / in_step:>7.1%}"
    )
    lines.append(f"{OUTSIDE:<50} {counts[OUTSIDE]:>8} (not in the step)")
    return "\n".join(lines)


def record(path: Path, offline_args: list[str]) -> None:
    bin_dir = Path(sys.executable).parent
    command = [
        str(bin_dir / "py-spy"),
        "record",
        "--rate",
        "250",
        "--format",
        "raw",
        "--output",
        str(path),
        "--",
        sys.executable,
        "-m",
        "nori.cli.main",
        "bench",
        "offline",
        "--repeats",
        "1",
        *offline_args,
    ]
    subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["record", "summarize"])
    parser.add_argument("file", type=Path)
    parser.add_argument("offline_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.action == "record":
        record(args.file, [a for a in args.offline_args if a != "--"])
    print(summarize(args.file))


if __name__ == "__main__":
    main()
