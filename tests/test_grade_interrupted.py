"""An interrupted `grade` never leaves half a report, nor two runs mixed (issue 50, section 1).

A first run writes a whole report; a second run on another class, into the same folder, is killed
(SIGKILL, SIGTERM, Ctrl-C) at a chosen point of writing its report: after the feedback, after
grades.csv, after the figure, once all is staged, in the middle of the swap (the old report out, or
some of the new files in). The hook (``report.PAUSE_VARIABLE``) holds the run at that point; a run that
has no such point (an older grader) is killed as soon as its new grades.csv appears instead. Afterwards
every report file a reader opens must be whole and from one run, all of them from the same one, or, only
for a SIGKILL inside the swap, new files beside stubs that say "report incomplete", summary.md among the
stubs; and the message printed on Ctrl-C or SIGTERM must say what is true.
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
from course_lib.classroom.grading.report import INCOMPLETE, MARKER, PAUSE_VARIABLE

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
    """The first run's whole report, and the second run's class."""
    root = tmp_path_factory.mktemp("interrupted")
    for folder, students in (("first", FIRST), ("second", SECOND)):
        for student, solved in students.items():
            write_student(root / folder / student, ["01"], solved=solved)
    done = subprocess.run(_command(root / "first", root / "report"), capture_output=True, text=True, env=_env(),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return root


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
    report = tmp_path / "report"
    shutil.copytree(first_report / "report", report)
    first_csv = (report / "grades.csv").read_bytes()
    first_png = (report / "summary.png").read_bytes()
    assert set(_run_of(report, first_png).values()) == {"first"}
    flag = tmp_path / "paused"
    grading = subprocess.Popen(_command(first_report / "second", report), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=_env(**{PAUSE_VARIABLE: f"{point}:{flag}"}),
                               start_new_session=True)
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
    hidden = [p.name for p in report.iterdir() if p.name.startswith(".") and p.name != MARKER]
    if hidden:
        from course_lib import _atomic
        old = time.time() - 2 * _atomic.STALE_AFTER_S
        for name in hidden:
            os.utime(report / name, (old, old))
        done = subprocess.run(_command(first_report / "second", report), capture_output=True, text=True, env=_env(),
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert [p.name for p in report.iterdir() if p.name.startswith(".") and p.name != MARKER] == []
        assert set(_run_of(report, first_png).values()) == {"second"}
