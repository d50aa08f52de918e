"""Benchmark (not a test): grade a synthetic class with `python -m course_lib grade` and print the time.

    nice python tests/bench_grade.py --students 30 --workers 2 [--isolation on|off]
    nice python tests/bench_grade.py --students 30 --workers 2 --compare --repeats 3

``--compare`` grades the same class with ``--isolation off`` and ``on`` in turns (off, on, off, on,
...), ``--repeats`` times each, and prints both side by side: the median, the spread (min to max)
of the wall time per student, and the ratio of the medians. Only a quiet machine gives a figure to quote.

Each student's notebooks 01-07 are learner copies whose exercise cells hold, drawn at random (seed
fixed), a correct attempt from the banks (tests/bank), a bank mistake, or nothing (unfinished).
The class is written into a temporary folder and removed afterwards (``--keep DIR`` keeps it).
The script also counts how many grades match the diagnosis each bank attempt is registered with.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic_class import random_class  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--students", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--notebooks", default="01,02,03,04,05,06,07")
    parser.add_argument("--keep", metavar="DIR", help="write the class and the report here and keep them")
    parser.add_argument("--isolation", choices=("auto", "on", "off"), default="auto",
                        help="passed to the command: each student in a bubblewrap sandbox, or not")
    parser.add_argument("--compare", action="store_true", help="time --isolation off and on, in turns, side by side")
    parser.add_argument("--repeats", type=int, default=3, help="with --compare: runs of each (default %(default)s)")
    args = parser.parse_args()
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="grade-bench-"))
    submissions, report = base / "class", base / "report"
    drawn = random_class(submissions, args.students, args.notebooks.split(","), seed=0)
    exercises = sorted({ex for holds in drawn.values() for ex in holds}, key=lambda e: tuple(map(int, e.split("."))))
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "course_lib", "grade", str(submissions), "--out", str(report),
               "--workers", str(args.workers), "--exercises", ",".join(exercises), "--isolation", args.isolation,
               "--quiet"]
    if args.compare:
        runs: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                shutil.rmtree(report, ignore_errors=True)
                seconds, done = _timed([*command[:-3], "--isolation", mode, "--quiet"], env)
                if done.returncode != 0:
                    print(done.stderr, file=sys.stderr)
                    return done.returncode
                runs[mode].append(seconds / args.students)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"{args.students} students x {len(exercises)} exercises ({args.notebooks}), {args.workers} workers, "
              f"{args.repeats} run(s) each, in turns; seconds per student:")
        for mode, values in runs.items():
            print(f"  isolation {mode:3s}: median {statistics.median(values):.2f}  (min {min(values):.2f}, "
                  f"max {max(values):.2f})  runs {', '.join(f'{v:.2f}' for v in values)}")
        print(f"  isolated / unisolated (medians): {statistics.median(runs['on']) / statistics.median(runs['off']):.2f}x; "
              f"load average now {load:.2f}, {os.cpu_count()} cores")
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        return 0
    seconds, done = _timed(command, env)
    print(done.stdout)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return done.returncode
    rows = list(csv.DictReader(open(report / "grades.csv", encoding="utf-8")))
    expected = {"correct": None, "unfinished": "not_implemented"}
    matches = sum((None if r["passed"] == "true" else r["diagnosis"]) ==
                  expected.get(drawn[r["student"]][r["exercise"]], drawn[r["student"]][r["exercise"]])
                  for r in rows)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"isolation {args.isolation}: "
          f"{args.students} students x {len(exercises)} exercises ({args.notebooks}) with {args.workers} workers: "
          f"{seconds:.1f} s wall for the whole command ({seconds / args.students:.2f} s per student); "
          f"{matches}/{len(rows)} grades are the diagnosis the bank registers; load average now {load:.2f}, "
          f"{os.cpu_count()} cores")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    return time.perf_counter() - start, done


if __name__ == "__main__":
    sys.exit(main())
