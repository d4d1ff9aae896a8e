"""Where a profiled ``bhfl run`` spent its wall time: a summary of py-spy's collapsed stacks.

``benchmarks/throughput.py --profile DIR`` records every process and thread of a run,
idle ones included (``py-spy record --subprocesses --idle --threads --format raw``), so a
thread's samples are its wall time and a waiting thread shows where it waits. For each
of the threads that ran most of bhfl's code this prints its share of the samples by the deepest frame of
bhfl's own code (bhfl_core, data_prep, tasks, flows) together with the first call below
it: the round loop's phases (training, folding, checkpoints, transfers, logging) read
off directly.

Run:  .venv/bin/python benchmarks/profile_summary.py DIR/10x3-0.txt [--threads 6] [--top 12]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

OURS = re.compile(r"\((?:.*/)?(bhfl_core|data_prep|tasks|flows)/[^:]*:\d+\)")
PROCESS = re.compile(r'process \d+:"(?:\S*/)?(?:python3?\S*\s+)?(?:-\S+\s+)*(\S+)(?:\s+(\S+))?')


def _process_name(frame: str) -> str:
    """A short name for a ``process <pid>:"<command line>"`` frame: the script or module and its first argument."""
    pid = frame.split(":", 1)[0].removeprefix("process ")
    m = PROCESS.match(frame)
    name = " ".join(p.rsplit("/", 1)[-1] for p in m.groups() if p) if m else frame[:40]
    return f"{name[:40]} [{pid}]"


def summarize(path: Path, threads: int, top: int) -> str:
    per_thread: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        where = (_process_name(procs[-1]) if procs else "?", thread.split(": ", 1)[-1])
        code = [i for i, f in enumerate(frames) if OURS.search(f)]
        if code:
            deepest = code[-1]
            below = frames[deepest + 1] if deepest + 1 < len(frames) else "(itself)"
            key = f"{frames[deepest]}  ->  {below}"
        else:
            key = f"(outside bhfl) {frames[-1]}"
        per_thread[where][key] += int(count)

    def in_bhfl(counts: Counter[str]) -> int:  # threads that ran bhfl's code first: the idle ones only wait
        return sum(n for key, n in counts.items() if not key.startswith("(outside bhfl)"))

    busiest = sorted(per_thread.items(), key=lambda kv: -in_bhfl(kv[1]))[:threads]
    out = []
    for (process, thread), counts in busiest:
        total = sum(counts.values())
        out.append(f"\n{process} / {thread}: {total} samples")
        for key, n in counts.most_common(top):
            out.append(f"  {100 * n / total:5.1f}%  {key[:160]}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--threads", type=int, default=6, help="how many of the busiest threads")
    parser.add_argument("--top", type=int, default=12, help="lines per thread")
    args = parser.parse_args()
    print(summarize(args.profile, args.threads, args.top))


if __name__ == "__main__":
    main()
