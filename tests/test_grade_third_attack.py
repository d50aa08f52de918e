"""What a third scripted attack on the grader found in its report, its names, its reading of submissions and its
processes (2026-11-29); the passes it forged are student "ursula" of the graded class (tests/test_grade.py)."""
from __future__ import annotations

import csv
import io
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.classroom.grading import worker
from course_lib.classroom.grading.grades import Grade, grade_from_message
from course_lib.classroom.grading.likeness import FLAG_SAME_AS_SOLUTION
from course_lib.classroom.grading.report import grades_csv
from course_lib.classroom.grading.submissions import find_submissions
from course_lib.classroom.grading.text import markdown_block, markdown_inline, name_from_student


def test_a_spreadsheet_that_splits_on_semicolons_still_reads_no_formula():
    raw = grades_csv([Grade("ada", "2.1", False, "exception", "http://grading-portal.example/;=HYPERLINK(B2)", 0.1)])
    for delimiter in (",", ";", "\t"):
        cells = [cell for row in csv.reader(io.StringIO(raw), delimiter=delimiter) for cell in row]
        assert not any(cell.lstrip("\"'").startswith("=") for cell in cells), (delimiter, cells)


def test_a_flag_is_one_of_the_graders_own_words():
    verdict = {"exercise": "2.1", "passed": True, "diagnosis": None, "message": "Right."}
    for forged in ("![](https://x.example/t.png)", "=HYPERLINK(\"https://x.example\";\"ok\")", "<b>look</b>"):
        assert grade_from_message("ada", "2.1", verdict, 0.1, forged).flag == ""
    assert grade_from_message("ada", "2.1", verdict, 0.1, FLAG_SAME_AS_SOLUTION).flag == FLAG_SAME_AS_SOLUTION


def test_an_address_in_student_text_is_shown_as_code_not_as_a_link():
    shown = markdown_inline("re-submit at https://grading-portal.example/a_b or www.portal.example [x](y)")
    assert "`https://grading-portal.example/a_b`" in shown and "`www.portal.example`" in shown
    assert "\\[x\\]\\(y\\)" in shown
    assert "`ftp://x.example/f`" in markdown_block("one\nsee ftp://x.example/f")


def test_names_that_read_alike_are_told_apart(tmp_path):
    assert name_from_student("bob\u200b") == "bob" == name_from_student("\ufeffb\u2060ob")
    for name in ("bob", "bob\u200b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "02_masked_attention.ipynb").write_text("{}")
    names = [s.student for s in find_submissions(tmp_path)]
    assert sorted(names) == ["bob", "bob (2)"]


def test_a_folder_the_grader_may_not_read_is_passed_over(tmp_path, monkeypatch):
    (tmp_path / "ada" / "week1").mkdir(parents=True)
    (tmp_path / "ada" / "week1" / "02_masked_attention.ipynb").write_text("{}")
    (tmp_path / "ada" / "locked").mkdir()
    iterdir = Path.iterdir

    def refusing(self):
        if self.name == "locked":
            raise PermissionError(13, "Permission denied", str(self))
        return iterdir(self)
    monkeypatch.setattr(Path, "iterdir", refusing)
    (ada,) = find_submissions(tmp_path)
    assert ada.student == "ada" and any(name.endswith("02_masked_attention.ipynb") for name in ada.files)


def test_a_check_that_cannot_start_is_the_students_crash_not_the_courses(monkeypatch):
    def full(*_):
        raise BlockingIOError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(worker.os, "fork", full)
    plan = type("Plan", (), {"id": "2.1"})()
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    verdict, _ = worker._run_child(plan, None, str(Path.cwd()), [], 5.0, None, [])
    assert (verdict["passed"], verdict["diagnosis"]) == (False, "crashed")
    assert "left behind" in verdict["message"]
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before   # the pipe is closed again


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"),
                    reason="the kernel's keyrings are Linux's")
def test_a_student_gets_a_session_keyring_of_its_own():
    script = ("import ctypes; from course_lib.classroom.grading import keyrings as k\n"
              "before = k._keyctl(0, -3, 1)\n"   # KEYCTL_GET_KEYRING_ID of the session keyring
              "k.own_session_keyring()\n"
              "print(before, k._keyctl(0, -3, 1))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    before, after = map(int, out)
    assert before > 0 and after > 0 and before != after


INLINE_FORGERY = '''
import json
import os

def causal_mask(n):
    verdict = {"exercise": "2.1", "passed": True, "diagnosis": None, "message": "forged"}
    line = json.dumps({"type": "grade", "student": "eve", "exercise": "2.1", "seconds": 0.1, "verdict": verdict,
                       "flag": "![](https://x.example/t.png)"}) + "\\n"
    for fd in range(3, 64):
        try:
            os.write(fd, line.encode())
        except OSError:
            pass
    return torch.zeros(n, n, dtype=torch.bool)
'''


@pytest.mark.slow
def test_graded_inline_a_line_the_submission_writes_into_the_channel_is_no_verdict(tmp_path):
    """--inline (Windows' path) runs the student's code in the worker that holds the line to the grader."""
    from synthetic_class import write_student

    from course_lib.classroom.grading import grade
    write_student(tmp_path / "submitted" / "eve", ["02"], {"2.1": INLINE_FORGERY})
    run = grade(tmp_path / "submitted", tmp_path / "report", workers=1, timeout=30, exercises=["2.1"], inline=True,
                isolate=False)
    (eve,) = run.grades
    assert not eve.passed and "forged" not in eve.message and eve.flag == "", eve
