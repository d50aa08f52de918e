"""An interrupted `grade` never leaves half a report, nor two runs mixed (issue 50, section 1).

A first run writes a whole report; a second run on another class, into the same folder, is killed
(SIGKILL, SIGTERM, Ctrl-C) at a chosen point of writing its report: after the feedback, after
grades.csv, after the figure, once all is staged, in the middle of the swap (the old report out, or
some of the new files in). The hook (``report.PAUSE_VARIABLE``) holds the run at that point; a run that
has no such point (an older grader) is killed as soon as its new grades.csv appears instead. Afterwards
every report file a reader opens must be whole and from one run, all of them from the same one, or, only
for a SIGKILL inside the swap, new files beside stubs that say "report incomplete", summary.md among the
stubs; and the message printed on Ctrl-C or SIGTERM must say what is true.

The first report is written by a real ``python -m course_lib grade``. The second class is graded once, for real
(the module's fixture); each interrupted run is then `grade`'s own command line (``cli.main``: its argument
parsing, its SIGTERM handler, its exit status and message, ``grade``'s checks and the report writer) in a
process forked from this one with that one grading handed back instead of graded again: the report is all
that is interrupted, and a new ``python -m course_lib grade`` per case cost ~22 s of CPU each (its imports
and its workers' start), 13 of them. The process starts in a session of its own with Python's default
handlers for Ctrl-C and SIGTERM, as ``python -m`` does.
"""
from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from synthetic_class import write_student

import course_lib
from course_lib.classroom import grading
from course_lib.classroom.grading.report import INCOMPLETE, LOCK, MARKER, PAUSE_VARIABLE

FIRST = {"ann": True, "ben": False}                  # student -> solved: the first run's class
SECOND = {"ann": False, "cat": True, "dan": True}    # the second run's: other students, other counts


def _command(submissions: Path, report: Path) -> list[str]:
    return [sys.executable, "-m", "course_lib", "grade", str(submissions), "--out", str(report), "--workers", "1",
            "--exercises", "1.1", "--isolation", "off", "--quiet"]


def _env(**extra: str) -> dict[str, str]:
    root = str(Path(course_lib.__file__).parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])), **extra}


@pytest.fixture(scope="module")
def first_report(tmp_path_factory):
    """The first run's whole report, the second run's class, and that class's grading (done once here)."""
    root = tmp_path_factory.mktemp("interrupted")
    for folder, students in (("first", FIRST), ("second", SECOND)):
        for student, solved in students.items():
            write_student(root / folder / student, ["01"], solved=solved)
    done = subprocess.run(_command(root / "first", root / "report"), capture_output=True, text=True, env=_env(),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    graded: list = []
    real = grading.grade_submissions

    def keep(*args, **kwargs):
        graded.append(real(*args, **kwargs))
        return graded[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grading, "grade_submissions", keep)
        grading.grade(root / "second", root / "second-once", workers=1, exercises=["1.1"], isolate=False)
    (grades, errors), = graded
    assert errors == [] and {g.student: g.passed for g in grades} == SECOND, grades
    return root, (grades, errors)


class _Forked:
    """`grade`'s command line in a child of this process, given the second class's grading (see the module's
    docstring); what the test needs of ``subprocess.Popen``."""

    def __init__(self, argv: list[str], graded: tuple, folder: Path, env: dict[str, str]):
        self.out, self.err = folder / "grade.stdout", folder / "grade.stderr"
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:   # the child: never returns into pytest
            code = 1
            try:
                os.setsid()
                signal.signal(signal.SIGINT, signal.default_int_handler)   # what a fresh `python -m` has
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.environ.clear()
                os.environ.update(env)
                sys.stdout, sys.stderr = open(self.out, "w"), open(self.err, "w")
                os.dup2(sys.stdout.fileno(), 1)
                os.dup2(sys.stderr.fileno(), 2)
                grading.grade_submissions = lambda found, plans, options, on_student: graded
                from course_lib.classroom.grading.cli import main
                code = main(argv[argv.index("grade") + 1:])
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def _status(self, status: int) -> int:
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = self._status(status)
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        deadline = time.monotonic() + (timeout or 600)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"grade (pid {self.pid})", timeout)
            time.sleep(0.01)
        return self.out.read_text(), self.err.read_text()


def _stub(text: str) -> bool:
    return INCOMPLETE in text.split("\n", 1)[0]


def _run_of(report: Path, first_png: bytes) -> dict[str, str]:
    """Which run each report file a reader opens comes from ("first", "second"), "incomplete" for a stub
    that says so on its first line, or why it is neither."""
    runs: dict[str, str] = {}
    if (report / "grades.csv").exists():
        text = (report / "grades.csv").read_text()
        students = set() if _stub(text) else {row["student"] for row in csv.DictReader(io.StringIO(text))}
        runs["grades.csv"] = "incomplete" if _stub(text) else "first" if students == set(FIRST) else \
            "second" if students == set(SECOND) else f"neither: {sorted(students)}"
    if (report / "summary.md").exists():
        text = (report / "summary.md").read_text()
        runs["summary.md"] = "incomplete" if _stub(text) else "first" if "ben" in text and "cat" not in text \
            else "second" if "cat" in text and "dan" in text and "ben" not in text else "neither"
    if (report / "summary.png").exists():
        data = (report / "summary.png").read_bytes()
        whole = data.startswith(b"\x89PNG") and data.rstrip().endswith(b"IEND\xaeB`\x82")
        runs["summary.png"] = ("first" if data == first_png else "second") if whole else "half a PNG"
    if (report / "feedback").is_dir():
        names = {p.stem for p in (report / "feedback").iterdir()}
        runs["feedback/"] = "first" if names == set(FIRST) else "second" if names == set(SECOND) \
            else "incomplete" if names == {"REPORT-INCOMPLETE"} else f"neither: {sorted(names)}"
        for path in (report / "feedback").iterdir():
            text = path.read_text()
            passed = "1 of 1 exercises passed" in text
            which = [run for run, students in (("first", FIRST), ("second", SECOND))
                     if path.stem in students and students[path.stem] == passed]
            runs[f"feedback/{path.name}"] = "incomplete" if _stub(text) else which[0] if len(which) == 1 else \
                ("either" if len(which) == 2 else "neither")
    return runs


POINTS = [("ann.md", signal.SIGKILL), ("grades.csv", signal.SIGKILL), ("grades.csv", signal.SIGTERM),
          ("grades.csv", signal.SIGINT), ("summary.png", signal.SIGINT), ("staged", signal.SIGTERM),
          ("swapping", signal.SIGKILL), ("swapping", signal.SIGINT), ("in:feedback", signal.SIGKILL),
          ("in:grades.csv", signal.SIGKILL)]


@pytest.mark.slow
@pytest.mark.parametrize("point, number", POINTS, ids=[f"{p}-{signal.Signals(n).name}" for p, n in POINTS])
def test_an_interrupted_run_leaves_one_whole_report_never_two_mixed(first_report, tmp_path, point, number):
    first_report, graded = first_report
    report = tmp_path / "report"
    shutil.copytree(first_report / "report", report)
    first_csv = (report / "grades.csv").read_bytes()
    first_png = (report / "summary.png").read_bytes()
    assert set(_run_of(report, first_png).values()) == {"first"}
    flag = tmp_path / "paused"
    grading = _Forked(_command(first_report / "second", report), graded, tmp_path,
                      env=_env(**{PAUSE_VARIABLE: f"{point}:{flag}"}))
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and grading.poll() is None and not flag.exists():
            try:
                now = (report / "grades.csv").read_bytes()
                if now != first_csv and INCOMPLETE.encode() not in now[:200]:
                    break   # a grader without the hook: its new grades.csv is out, its summary not yet
            except OSError:
                pass
            time.sleep(0.005)
        assert grading.poll() is None, "the run ended before the point where it was to be interrupted"
        grading.send_signal(number)
        time.sleep(0.2)
        flag.unlink(missing_ok=True)   # a run that holds the signal till its swap is done may go on now
        out, err = grading.communicate(timeout=120)
    finally:
        if grading.poll() is None:
            grading.kill()
            grading.communicate()
    runs = _run_of(report, first_png)
    swap = point == "swapping" or point.startswith("in:")
    if swap and number == signal.SIGKILL:   # one run's files and stubs that say so, summary.md a stub till the end
        values = set(runs.values())
        assert values <= {"first", "incomplete"} or values <= {"second", "incomplete"}, runs   # never both runs
        assert {"grades.csv", "summary.md", "feedback/"} <= set(runs), runs
        assert runs["summary.md"] == ("second" if values == {"second"} else "incomplete"), runs
    else:
        assert len(set(runs.values())) <= 1 and set(runs.values()) <= {"first", "second"}, runs
    if not swap:   # before the swap, the previous report is all there, untouched
        assert set(runs.values()) == {"first"} and len(runs) == 4 + len(FIRST), runs
        assert (report / "grades.csv").read_bytes() == first_csv
    elif number != signal.SIGKILL:   # Ctrl-C or SIGTERM inside the swap waits for it: the new report, whole
        assert set(runs.values()) == {"second"} and len(runs) == 4 + len(SECOND), runs
    if number != signal.SIGKILL:
        assert grading.returncode == (130 if number == signal.SIGINT else 143), err[-2000:]
        said = err.strip().splitlines()[-1]
        if runs and set(runs.values()) == {"first"}:
            assert "previous report, unchanged" in said, said
        else:
            assert "this run's, whole" in said, said
    # what the killed run left hidden goes with a later run, once its writer is gone
    hidden = [p.name for p in report.iterdir() if p.name.startswith(".") and p.name not in (MARKER, LOCK)]
    if swap and number != signal.SIGKILL:   # a held Ctrl-C or SIGTERM waits for the old report's removal too
        assert hidden == [], hidden
    if hidden:
        from course_lib import _atomic
        old = time.time() - 2 * _atomic.STALE_AFTER_S
        for name in hidden:
            os.utime(report / name, (old, old))
        again = _Forked(_command(first_report / "second", report), graded, tmp_path, env=_env())
        out, err = again.communicate(timeout=600)
        assert again.returncode == 0, err[-2000:]
        assert [p.name for p in report.iterdir() if p.name.startswith(".") and p.name not in (MARKER, LOCK)] == []
        assert set(_run_of(report, first_png).values()) == {"second"}
