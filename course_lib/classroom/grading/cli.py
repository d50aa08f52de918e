"""``python -m course_lib grade SUBMISSIONS --out REPORT``: grade a class, print the room's summary.

Exit status: 0 when every submission was graded (whatever the grades); 1 when grading itself
failed (a worker could not start, or the grader hit a bug of its own: the report is still written,
and says which grades it affects); 2 for arguments that cannot work; 130 on Ctrl-C, 143 on SIGTERM
(the report is the whole new one or, if the run stopped before it, the previous one untouched; the
message says which).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["main", "build_parser", "exercise_ids", "number"]

EPILOG = """\
report files:
  REPORT/grades.csv           student, exercise, passed, diagnosis, message, seconds, flag
  REPORT/summary.md, .png     per exercise: passed, mistakes with counts, what to tell the room
  REPORT/feedback/NAME.md     each student's verdicts, messages and hints
  REPORT/results.json         --format gradescope, one student (REPORT/gradescope/NAME/ for several)

before anyone is graded, the course's own solution notebooks and learner copies are graded: a
solution that fails, or a blank exercise that passes, stops the run (exit status 1) naming it.

interrupted (Ctrl-C, SIGTERM, a kill), a run leaves the previous report as it was, or the whole new
one, never two mixed; a kill (SIGKILL) landing inside the last step, a dozen renames, leaves each file
either new or a stub saying "report incomplete" (summary.md says so until the last rename).

exit status: 0 graded (whatever the grades); 1 grading itself failed; 2 bad arguments; 130 Ctrl-C;
143 SIGTERM
"""


def number(kind: type, ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` where ``ok`` of it, else "expected EXPECTED, got TEXT" (``autograder`` too)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


_positive_int = number(int, lambda value: value > 0, "a positive whole number")
MEMORY_FLOOR_MB = 64   # below this nothing runs; above it, the self-check finds a limit the solutions need more than
_memory = number(int, lambda value: value == 0 or value >= MEMORY_FLOOR_MB,
                 f"megabytes ({MEMORY_FLOOR_MB} or more), or 0 for no limit")
_seconds = number(float, lambda value: 0 < value <= 86_400, "a number of seconds > 0, at most 86400 (a day)")


def exercise_ids(text: str) -> list[str]:
    """"all", or ids and notebook numbers: "2.1,2.2", "02,03" (``grade`` and ``autograder`` take them so)."""
    from .plan import CAPSTONE, default_exercises
    known = default_exercises() + [CAPSTONE]
    if text.strip() == "all":
        return known
    chosen: list[str] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item.isascii() and item.isdigit():   # "²" is a digit to str.isdigit, not to int()
            matches = [ex for ex in known if int(ex.split(".")[0]) == int(item)]
        else:
            matches = [item] if item in known else []
        if not matches:
            raise argparse.ArgumentTypeError(f"expected exercise ids ({', '.join(known)}), notebook numbers "
                                             f"(01 to {max(int(ex.split('.')[0]) for ex in known):02d}) or 'all', got {item!r}")
        chosen += [ex for ex in matches if ex not in chosen]
    if not chosen:
        raise argparse.ArgumentTypeError(f"expected at least one exercise, got {text!r}")
    return chosen


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib grade", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Grade a class's notebooks with the course's checkers, each submission sandboxed; write "
                    "grades, the class's summary and each student's feedback.")
    parser.add_argument("submissions", metavar="SUBMISSIONS",
                        help="one folder per student holding their notebooks (nbgrader's submitted/ works too)")
    parser.add_argument("--out", metavar="REPORT", required=True, help="the report's folder")
    parser.add_argument("--workers", type=_positive_int, default=os.cpu_count() or 1,
                        help="students graded at once (default: the machine's cores, %(default)s here)")
    parser.add_argument("--timeout", type=_seconds, default=60.0, metavar="SECONDS",
                        help="time limit per notebook; its exercises share it (default %(default)g)")
    parser.add_argument("--memory-mb", type=_memory, default=2048, metavar="MB",
                        help="memory per exercise beyond the course's own, 0 for none (default %(default)s)")
    parser.add_argument("--exercises", type=exercise_ids, default=None, metavar="IDS",
                        help="'2.1,2.2', notebook numbers '02,03', or 'all' (default: every exercise but 8.1, "
                             "that is 1.1 to 7.2 and 9.1 to 12.3; 8.1 trains two models per student)")
    parser.add_argument("--format", choices=("report", "gradescope"), default="report",
                        help="'gradescope' also writes Gradescope's results.json")
    parser.add_argument("--inline", action="store_true",
                        help="grade each student in one fresh process, without a process per exercise "
                             "(what Windows does; for testing that path)")
    parser.add_argument("--isolation", choices=("auto", "on", "off"), default="auto",
                        help="each student in a bubblewrap sandbox of their own: 'auto' where bwrap runs here "
                             "(default), 'on' to require it, 'off' for the per-process sandbox only")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tqdm import tqdm

    from ..exercises import exercise_order
    from . import grade
    from .pool import SelfCheckFailed
    bar = None

    def started(total: int) -> None:
        nonlocal bar
        bar = tqdm(total=total, unit="student", file=sys.stderr, disable=args.quiet, desc="grading")

    def graded(submission, grades) -> None:
        bar.set_postfix_str(f"{submission.student}: {sum(g.passed for g in grades)}/{len(grades)}", refresh=False)
        bar.update(1)

    terminated: list[int] = []

    def on_sigterm(number, frame) -> None:   # like Ctrl-C: the workers are stopped, the message is printed
        terminated.append(number)
        raise KeyboardInterrupt

    previous_handler = signal.signal(signal.SIGTERM, on_sigterm)
    isolate = {"auto": None, "on": True, "off": False}[args.isolation]
    if isolate is not False:   # one line at the start, whichever way it goes
        from .isolation import status
        isolated, line = status()
        print(f"grading {line}" if isolated else f"warning: grading {line}", file=sys.stderr)
    try:
        run = grade(args.submissions, args.out, workers=args.workers, timeout=args.timeout,
                    memory_mb=args.memory_mb or None, exercises=args.exercises,
                    gradescope=args.format == "gradescope", inline=args.inline, isolate=isolate,
                    on_student=graded, on_start=started)
    except SelfCheckFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:   # a report folder that cannot be written (read-only, full, a file in the way)
        print(f"error: out: could not write the report in {args.out} ({exc.strerror or exc}"
              f"{f': {exc.filename}' if exc.filename else ''}); choose a folder you can write, with room",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: {_what_was_left(args.out)}", file=sys.stderr)
        return 143 if terminated else 130
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        if bar is not None:
            bar.close()
    students = len(run.submissions)
    exercises = sorted({g.exercise for g in run.grades}, key=exercise_order)
    passed = sum(g.passed for g in run.grades)
    print(f"graded {students} student(s) x {len(exercises)} exercise(s) in {run.seconds:.1f} s with "
          f"{min(args.workers, students)} worker(s): {passed}/{len(run.grades)} passed")
    for ex in exercises:
        mine = [g for g in run.grades if g.exercise == ex]
        mistakes = Counter(g.diagnosis for g in mine if not g.passed).most_common()
        tail = "; " + ", ".join(f"{code} {n}" for code, n in mistakes) if mistakes else ""
        print(f"  {ex}: {sum(g.passed for g in mine)}/{len(mine)} passed{tail}")
    print(f"report: {args.out} (grades.csv, summary.md, summary.png, feedback/"
          f"{', results.json' if args.format == 'gradescope' else ''})")
    for error in run.errors:
        print(f"error: grading failed: {error}", file=sys.stderr)
    return 1 if run.errors else 0


def _what_was_left(out: str) -> str:
    """What an interrupted run left in ``out``, as the report's marker says it (see ``report``)."""
    from pathlib import Path

    from .report import OURS, report_state
    folder = Path(out)
    state, pid = report_state(folder)
    if state == "whole" and pid == os.getpid():
        return f"the report in {out} is this run's, whole (it was written before the interruption)"
    if any((folder / name).exists() for name in OURS):
        return f"no new report written; {out} holds the previous report, unchanged"
    return "no report written"
