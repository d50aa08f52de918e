"""`python -m course_lib grade`: which exercise is checked how, what is taken from a notebook, the
sandbox, the report, and a small class graded end to end (with hostile submissions)."""
from __future__ import annotations

import base64
import csv
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from bank import attention_bugs
from synthetic_class import (
    FORGED_VERDICT,
    FORGERIES,
    FORGERIES_2,
    attempt_source,
    hostile_parts,
    prediction_source,
    write_student,
)

from course_lib.classroom import checks
from course_lib.classroom.collect import course_namespace
from course_lib.classroom.grading import grade, grading_plan, handed_in, sandbox
from course_lib.classroom.grading.advice import room_advice
from course_lib.classroom.grading.cli import build_parser
from course_lib.classroom.grading.cli import main as grade_main
from course_lib.classroom.grading.grades import Grade
from course_lib.classroom.grading.judge import judge, known_names
from course_lib.classroom.grading.pool import SelfCheckFailed
from course_lib.classroom.grading.report import (
    FIXED_STYLES,
    OKABE_ITO,
    RunInfo,
    figure_styles,
    grades_csv,
    summary_figure,
    write_report,
)
from course_lib.classroom.grading.sandbox import install_policy
from course_lib.classroom.grading.selfcheck import self_check
from course_lib.classroom.grading.sources import find_notebook, student_part, unfinished_exercises
from course_lib.classroom.grading.submissions import Submission, find_submissions
from course_lib.classroom.grading.worker import _write_files, exercise_limits
from course_lib.classroom.notebook_reader import without_magics
from course_lib.classroom.verdict import DIAGNOSES

PLANS = grading_plan()
KNOWN = known_names(PLANS)
CLASS_EXERCISES = ["1.1", "1.2", "1.3", "2.1", "2.2", "3.1", "3.2", "3.3"]


def _notebook(*sources: str) -> str:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    return nbformat.writes(notebook)


def _bank(name: str):
    return next(a for a in attention_bugs.BUGGY + attention_bugs.CORRECT if a.name == name)


def _checker(exercise: str):
    return getattr(checks, re.search(r"checks\.(check_\w+)", PLANS[exercise].check)[1])


# ---------------------------------------------------------------- what is checked, and how

def test_each_check_is_read_from_the_course_notebook():
    assert PLANS["2.1"].check.strip() == "checks.check_causal_mask(causal_mask)"
    # 4.2 is checked twice in its notebook, pre-norm then post-norm: both cells are taken
    assert "check_transformer_block(TransformerBlock)" in PLANS["4.2"].check
    assert "norm_first=False" in PLANS["4.2"].check
    # 1.1's check cell calls the student's my_prediction() itself
    assert "my_prediction()" in PLANS["1.1"].check
    # the notebooks' demonstrations of planted bugs are not part of any exercise's check
    assert all("Buggy" not in plan.check and "buggy" not in plan.check for plan in PLANS.values())
    assert "8.1" not in PLANS and "8.1" in grading_plan(["8.1"])
    with pytest.raises(ValueError, match="exercises: expected ids"):
        grading_plan(["9.9"])


def test_a_definition_comes_with_what_it_names_and_nothing_else():
    text = _notebook(
        "import numpy as np\nSCALE = 1.0",
        "x = expensive_setup()\nprint('hello')",
        "def _lower(n):\n    return np.tril(np.ones((n, n))) * SCALE",
        "%timeit 1 + 1\ndef as_bool(t):\n    return torch.as_tensor(t).bool()\n\n"
        "def causal_mask(n):\n    return as_bool(_lower(n))\n\nprint(causal_mask(3))")
    part = student_part(text, PLANS["2.1"], KNOWN)
    assert part.diagnosis is None
    for needed in ("import numpy as np", "SCALE = 1.0", "def _lower", "def as_bool", "def causal_mask"):
        assert needed in part.source
    for unwanted in ("expensive_setup", "print(", "timeit"):
        assert unwanted not in part.source
    assert judge(PLANS["2.1"], part.source)["passed"] is True


def test_a_name_the_course_provides_is_never_taken_from_the_students_other_cells():
    # the notebook carries on with the course's causal_mask after 2.1: so does 2.2, whatever 2.1 holds
    text = _notebook("def causal_mask(n):\n    raise NotImplementedError('Exercise 2.1: ...')",
                     PLANS["2.2"].solution)
    part = student_part(text, PLANS["2.2"], KNOWN)
    assert "def causal_mask" not in part.source
    assert judge(PLANS["2.2"], part.source)["passed"] is True


def test_an_unfinished_exercise_gets_its_own_verdict_never_the_solutions_pass(tmp_path):
    write_student(tmp_path / "learner", ["01", "02"])
    for ex_id, name in (("1.1", "01_attention_toy.ipynb"), ("2.1", "02_masked_attention.ipynb"),
                        ("2.2", "02_masked_attention.ipynb")):
        part = student_part((tmp_path / "learner" / name).read_text(), PLANS[ex_id], KNOWN)
        assert "NotImplementedError" in part.source
        verdict = judge(PLANS[ex_id], part.source)
        assert (verdict["passed"], verdict["diagnosis"]) == (False, "not_implemented")


def test_missing_and_broken_exercises_say_why():
    assert student_part(None, PLANS["2.1"], KNOWN, missing_detail="no 02 here").diagnosis == "missing"
    unreadable = student_part("{not json", PLANS["2.1"], KNOWN)
    assert unreadable.diagnosis == "missing" and "cannot be read" in unreadable.message
    assert student_part(_notebook("x = 1"), PLANS["2.1"], KNOWN).diagnosis == "missing"
    broken = student_part(_notebook("def causal_mask(n):\n    return (n"), PLANS["2.1"], KNOWN)
    assert broken.diagnosis == "exception" and "SyntaxError" in broken.message
    defined_badly = judge(PLANS["2.1"], "@undefined_decorator\ndef causal_mask(n):\n    pass")
    assert defined_badly["diagnosis"] == "exception" and "NameError" in defined_badly["message"]


def test_a_renamed_notebook_is_found_by_its_number_unless_it_is_ambiguous():
    assert find_notebook(["02_masked_attention (1).ipynb"], "02_masked_attention.ipynb")[0] == \
        "02_masked_attention (1).ipynb"
    found, why = find_notebook(["02_a.ipynb", "02_b.ipynb"], "02_masked_attention.ipynb")
    assert found is None and "several" in why
    assert find_notebook(["020_x.ipynb"], "02_masked_attention.ipynb")[0] is None


def test_a_renamed_copy_holding_the_work_is_graded_and_the_report_says_which_file(tmp_path):
    original, copy = "01_attention_toy.ipynb", "01_attention_toy (1).ipynb"
    write_student(tmp_path / "s", ["01"])
    untouched = (tmp_path / "s" / original).read_text()
    write_student(tmp_path / "w", ["01"], solved=True)
    worked = (tmp_path / "w" / original).read_text()
    counts = {original: unfinished_exercises(untouched), copy: unfinished_exercises(worked)}
    assert counts == {original: 3, copy: 0}
    found, note = find_notebook([original, copy], original, counts)
    assert found == copy and note == f"graded {copy} as {original}; ignored {original}"
    # both written (or both untouched): the course's name wins, and the note names the copy left aside
    found, note = find_notebook([original, copy], original, {original: 0, copy: 0})
    assert found == original and note.endswith(f"ignored {copy}")
    files = {original: base64.b64encode(untouched.encode()).decode(), copy: base64.b64encode(worked.encode()).decode()}
    home = tmp_path / "home"
    home.mkdir()
    found = _write_files(str(home), files, {original})
    assert found["texts"][original] == worked and found["notes"] == [f"graded {copy} as {original}; ignored {original}"]


def test_magic_lines_are_dropped_only_where_a_statement_starts():
    source = ("%%time\n!pip list\ndef causal_mask(n):\n    keep = (torch.ones(n, n)\n            != 0)\n"
              "    rows = (n\n            % 7)\n    %time x = 1\n    return keep.tril()\n")
    cleaned = without_magics(source)
    assert cleaned.splitlines()[:2] == ["pass", "pass"] and "            != 0)" in cleaned and "% 7)" in cleaned
    assert "    pass" in cleaned.splitlines()   # an indented magic inside the body, at a statement's start
    part = student_part(_notebook(source), PLANS["2.1"], KNOWN)
    assert part.diagnosis is None, part.message
    assert judge(PLANS["2.1"], part.source)["passed"] is True


def test_a_definition_moved_to_another_cell_is_graded_with_a_note():
    learner = nbformat.v4.new_notebook()
    exercise = nbformat.v4.new_code_cell("# moved below")
    exercise["id"] = PLANS["2.1"].cell_id
    learner.cells = [exercise, nbformat.v4.new_code_cell("x = 1"),
                     nbformat.v4.new_code_cell("def causal_mask(n):\n    return torch.ones(n, n, dtype=torch.bool)")]
    part = student_part(nbformat.writes(learner), PLANS["2.1"], KNOWN)
    assert part.source is not None and "code cell 3" in part.note and "no longer defines it" in part.note
    assert judge(PLANS["2.1"], part.source)["diagnosis"] == "causal_mask"   # graded, not "missing"


def test_a_name_rebound_from_itself_takes_the_definition_before_it():
    """Notebook 09's ``apply_rotary = apply_rotary if checks.check_apply_rotary(...) else ...`` kind of line."""
    text = _notebook("def _tri(n):\n    return torch.ones(n, n, dtype=torch.bool).tril()",
                     "_tri = _tri if checks.check_causal_mask(_tri, graded=False) else None",
                     "def causal_mask(n):\n    return _tri(n)")
    part = student_part(text, PLANS["2.1"], KNOWN)
    assert part.source.index("def _tri") < part.source.index("_tri = _tri")
    assert judge(PLANS["2.1"], part.source)["passed"] is True


def test_the_default_exercises_are_every_exercise_cell_9_2_and_9_6_included():
    assert list(PLANS) == ["1.1", "1.2", "1.3", "2.1", "2.2", "3.1", "3.2", "3.3", "4.1", "4.2", "4.3", "5.1", "5.2",
                           "5.3", "5.4", "6.1", "6.2", "7.1", "7.2", "9.1", "9.2", "9.3", "9.4", "9.5", "9.6",
                           "10.1", "10.2", "10.3", "11.1", "11.2", "11.3", "12.1", "12.2", "12.3"]
    assert PLANS["9.2"].name == "apply_rotary" and "def rotate_half" in PLANS["9.2"].solution
    help_text = build_parser().format_help()
    assert f"1.1 to 7.2 and 9.1 to {list(PLANS)[-1]}" in " ".join(help_text.split())


@pytest.mark.slow
def test_the_grader_passes_every_solution_and_fails_every_blank_exercise():
    """The self-check each grading run starts with, on the course as it is: 25 exercises."""
    assert self_check(PLANS) == []


def test_a_broken_judge_is_caught_by_the_self_check_naming_the_exercise():
    broken = {"2.1": dataclasses.replace(PLANS["2.1"], check="checks.check_causal_mask(lambda n: None)"),
              "3.2": dataclasses.replace(PLANS["3.2"], check="def ours(x):\n"
                                                         "    n, h, t, d = x.shape\n"
                                                         "    return x.transpose(1, 2).reshape(n, t, h * d)\n"
                                                         "checks.check_merge_heads(ours)")}
    problems = self_check(broken)
    assert any(p.startswith("exercise 2.1 (causal_mask): the course's solution failed") for p in problems)
    assert any(p.startswith("exercise 3.2 (merge_heads): the learner copy's blank exercise passed") for p in problems)


def test_the_command_stops_with_an_error_when_the_self_check_fails(tmp_path, monkeypatch, capsys):
    (tmp_path / "class" / "ada").mkdir(parents=True)

    def failing(*args, **kwargs):
        raise SelfCheckFailed(["exercise 9.6 (GroupedQueryAttention): the course's solution failed (exception: x)"])
    monkeypatch.setattr("course_lib.classroom.grading.grade", failing)
    assert grade_main([str(tmp_path / "class"), "--out", str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "self-check failed" in err and "exercise 9.6" in err


def test_a_notebooks_exercises_share_its_time_limit():
    used, budget = 0.0, 60.0
    for left in (4, 3, 2, 1):   # each exercise takes all it is given: the total still fits the budget
        used += exercise_limits(budget, used, left)
    assert used == pytest.approx(budget)
    assert exercise_limits(60.0, 0.0, 4) == 15.0
    assert exercise_limits(60.0, 1.0, 3) > 15.0   # the first took 1 s of its 15: the others share the rest


# ---------------------------------------------------------------- finding submissions

def test_submissions_in_both_layouts_are_read_into_memory(tmp_path, monkeypatch):
    plain = tmp_path / "plain"
    (plain / "ada").mkdir(parents=True)
    (plain / "ada" / "02_masked_attention.ipynb").write_text("{}")
    (plain / "ada" / ".ipynb_checkpoints").mkdir()
    (plain / "ada" / ".ipynb_checkpoints" / "02_masked_attention-checkpoint.ipynb").write_text("{}")
    (plain / "ada" / "big.bin").write_bytes(b"x" * 200)
    (plain / "ada" / "link.ipynb").symlink_to(plain / "ada" / "02_masked_attention.ipynb")
    (plain / "bo").mkdir()   # handed in nothing: still a student, graded as missing
    monkeypatch.setattr("course_lib.classroom.grading.submissions.FILE_LIMIT", 100)
    found = {s.student: s for s in find_submissions(plain)}
    assert sorted(found) == ["ada", "bo"]
    assert sorted(found["ada"].files) == ["02_masked_attention.ipynb"]
    assert any("big.bin" in note for note in found["ada"].notes)
    assert found["bo"].files == {}

    nbgrader = tmp_path / "submitted"
    for assignment, text in (("week1", "old"), ("week2", "new")):
        folder = nbgrader / "ada" / assignment
        folder.mkdir(parents=True)
        (folder / "02_masked_attention.ipynb").write_text(text)
        os.utime(folder / "02_masked_attention.ipynb", (1, 1 if text == "old" else 2))
    (nbgrader / "ada" / "week1" / "01_attention_toy.ipynb").write_text("one")
    ada = find_submissions(nbgrader)[0]
    assert ada.files == {"01_attention_toy.ipynb": b"one", "02_masked_attention.ipynb": b"new"}
    assert any("two places" in note for note in ada.notes)

    single = tmp_path / "submission"   # Gradescope's /autograder/submission: the notebooks themselves
    single.mkdir()
    (single / "02_masked_attention.ipynb").write_text("{}")
    assert [s.student for s in find_submissions(single)] == ["submission"]


# ---------------------------------------------------------------- the sandbox's policy

def test_the_policy_refuses_what_reaches_beyond_the_submission(tmp_path):
    home, other = tmp_path / "home", tmp_path / "other"
    home.mkdir()
    other.mkdir()
    (other / "notebook.ipynb").write_text("theirs")
    attempts = {
        "read another's file": lambda: open(other / "notebook.ipynb").read(),
        "list another's folder": lambda: os.listdir(other),
        "write outside": lambda: open(tmp_path / "outside.txt", "w").close(),
        "remove another's file": lambda: os.remove(other / "notebook.ipynb"),
        "signal the parent": lambda: os.kill(os.getppid(), 0),
        "start a process": lambda: subprocess.run(["true"]),
        "start a process after emptying the policy's table": lambda: (sandbox._REFUSED_EVENTS.clear(),
                                                                      subprocess.run(["true"])),
        "read the parent's memory map": lambda: open(f"/proc/{os.getppid()}/maps").read(),
        "write in its own folder": lambda: (home / "mine.txt").write_text("ok"),
        "read a course file": lambda: Path(checks.__file__).read_text()[:1],
    }
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: installs the policy for good, tries everything, reports, exits
        try:
            install_policy(str(home), [str(other)])
            outcome = {}
            for name, attempt in attempts.items():
                try:
                    attempt()
                    outcome[name] = "allowed"
                except PermissionError:
                    outcome[name] = "refused"
            os.write(write_end, json.dumps(outcome).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        outcome = json.loads(pipe.read())
    os.waitpid(pid, 0)
    allowed = {"write in its own folder", "read a course file"}
    assert outcome == {name: "allowed" if name in allowed else "refused" for name in attempts}
    assert (other / "notebook.ipynb").read_text() == "theirs"


def test_the_hostile_submissions_attacks_are_real_outside_the_sandbox(tmp_path):
    """Without the sandbox, the test class's file attacks get through (so the class test can fail)."""
    victim = tmp_path / "alice.ipynb"
    victim.write_text("alice's work")
    parts = hostile_parts(victim, tmp_path, tmp_path / "report")
    namespace = course_namespace()
    exec(parts["3.2"], namespace)
    import torch
    with pytest.raises(RuntimeError, match="attack got through"):
        namespace["merge_heads"](torch.zeros(1, 2, 3, 4))
    assert victim.read_text() == "tampered"


# ---------------------------------------------------------------- the report, from known grades

def _grades() -> list[Grade]:
    rows = [("ada", "2.1", True, None, "Right."), ("bo", "2.1", False, "causal_mask", "The future leaks."),
            ("cy", "2.1", False, "not_implemented", "Not written yet."),
            ("dee", "2.1", False, "not_implemented", "Not written yet."),
            ("ada", "3.1", False, "shape", "Wrong shape | really."), ("bo", "3.1", True, None, "Right."),
            ("cy", "3.1", True, None, "Right."), ("dee", "3.1", True, None, "Right.")]
    return [Grade(s, e, p, d, m, 0.25) for s, e, p, d, m in rows]


def _info() -> RunInfo:
    return RunInfo(students=4, workers=2, timeout=60, memory_mb=2048, seconds=3.0, sandbox="test")


def test_the_report_says_per_exercise_who_passed_and_what_to_tell_the_room(tmp_path):
    out = tmp_path / "report"
    write_report(out, _grades(), _info(), gradescope=True)
    rows = list(csv.DictReader(io.StringIO((out / "grades.csv").read_text())))
    assert list(rows[0]) == ["student", "exercise", "passed", "diagnosis", "message", "seconds", "flag"]
    assert [(r["student"], r["exercise"], r["passed"], r["diagnosis"]) for r in rows][:3] == [
        ("ada", "2.1", "true", ""), ("ada", "3.1", "false", "shape"), ("bo", "2.1", "false", "causal_mask")]
    summary = (out / "summary.md").read_text()
    assert "## 2.1: 1/4 passed; not_implemented 2, causal_mask 1" in summary
    # the room's hint is for the most common real mistake, not for "not written yet"
    assert re.search(r"\*\*Tell the room\*\* \(causal_mask, 1 student\(s\)\): .*tril", summary)
    assert "Wrong shape \\| really." not in summary and "shape 1" in summary
    feedback = (out / "feedback" / "bo.md").read_text()
    assert "The future leaks." in feedback and "Hint:" in feedback
    assert "torch.ones(n, n, dtype=torch.bool).tril()" not in feedback   # never the solution
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "gradescope" / "bo" / "results.json").read_text())
    assert results["score"] == 1.0 and len(results["tests"]) == 2
    test = next(t for t in results["tests"] if t["number"] == "2.1")
    assert (test["score"], test["max_score"], test["status"]) == (0.0, 1.0, "failed")
    assert "causal_mask" in test["output"] and "The future leaks." in test["output"]


def test_the_rooms_advice_is_chosen_per_exercise_and_diagnosis():
    # one code, several meanings: 5.4's ignored temperature is not attention's 1/sqrt(d)
    assert "temperature" in room_advice("5.4", "scale") and "square root" not in room_advice("5.4", "scale")
    assert "square root" in room_advice("1.3", "scale")
    assert "no scaling" in room_advice("1.2", "scale")
    # a general code keeps to what holds everywhere: 9.2's half precision is not 1.1's rounding
    assert "decimals" in room_advice("1.1", "precision") and "decimals" not in room_advice("9.2", "precision")
    assert "token embedding" in room_advice("6.1", "weights_count")
    # a code with no advice written for this exercise: what the checker told most of them, never another's advice
    said = ["You add the residual after the norm.", "You add the residual after the norm.", "Other."]
    assert room_advice("9.3", "residual", said) == 'The checker told 2 of them: "You add the residual after the norm."'
    assert "none of the known mistakes" not in room_advice("6.1", "mismatch", ["Your FLOPs count is 2N."])
    assert "2N" in room_advice("6.1", "mismatch", ["Your FLOPs count is 2N."])
    # the codes for the mistakes that had none, each with advice for its exercise
    for key, word in {("5.3", "zero_grad"): "zero_grad", ("6.1", "flops_factor"): "6 FLOPs",
                      ("7.1", "split_transpose"): "Conv1D", ("4.3", "final_norm"): "ln_f",
                      ("6.2", "no_kv_cache"): "cache", ("5.1", "overlapping_windows"): "max_tokens tokens apart"}.items():
        assert word in room_advice(*key), key
    # codes that mean the same everywhere keep their one sentence
    assert room_advice("9.6", "timeout") == room_advice("2.1", "timeout") != ""


def test_csv_cells_that_a_spreadsheet_would_run_are_escaped(tmp_path):
    hostile = [Grade("=1+2", "2.1", False, "exception", "=HYPERLINK(\"http://x\",\"click\")", 0.1),
               Grade("@bob", "2.1", False, "exception", "+cmd|' /C calc'!A0", 0.1),
               Grade("-eve", "2.1", False, "exception", "-2+3", 0.1),
               Grade("ada", "2.1", True, None, "Right: scores - max.", 0.1)]
    rows = list(csv.DictReader(io.StringIO(grades_csv(hostile))))
    assert {r["student"] for r in rows} == {"'=1+2", "'@bob", "'-eve", "ada"}
    assert {r["message"] for r in rows} == {"'=HYPERLINK(\"http://x\",\"click\")", "'+cmd|' /C calc'!A0", "'-2+3",
                                            "Right: scores - max."}
    assert all(not cell.startswith(("=", "+", "-", "@")) for r in rows for cell in r.values())


def test_a_one_notebook_gradescope_submission_is_scored_on_that_notebooks_exercises(tmp_path):
    plans = grading_plan()
    one = Submission("ada", {"02_masked_attention (1).ipynb": b"{}", "notes.txt": b""})
    assert handed_in(one, plans) == {"2.1", "2.2"}
    grades = [Grade("ada", ex, ex == "2.1", None if ex == "2.1" else "missing" if ex[0] != "2" else "causal_mask",
                    "m", 0.1) for ex in plans]
    out = tmp_path / "results"
    info = dataclasses.replace(_info(), students=1, scored={"ada": handed_in(one, plans)})
    write_report(out, grades, info, gradescope=True)
    results = json.loads((out / "results.json").read_text())
    assert [t["number"] for t in results["tests"]] == ["2.1", "2.2"]
    assert results["score"] == 1.0 and results["output"] == "1 of 2 exercises passed."
    # chosen exercises (or nothing handed in): scored on all of them
    write_report(out, grades, _info(), gradescope=True)
    assert len(json.loads((out / "results.json").read_text())["tests"]) == len(plans)


def test_the_figures_colours_are_colour_blind_safe_and_never_repeat():
    codes = list(DIAGNOSES)
    styles = figure_styles(codes)
    assert len(set(styles.values())) == len(styles)   # no two labels drawn alike
    safe = set(OKABE_ITO) | {colour for colour, _ in FIXED_STYLES.values()}
    assert all(colour in safe for colour, _ in styles.values())
    assert styles["passed"][0] == "#009E73"
    png = summary_figure(_grades())
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figure_of_a_class_with_no_grades_yet_draws_without_a_warning():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # matplotlib warns of a legend with nothing in it
        assert summary_figure([])[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_second_run_replaces_its_own_report_and_refuses_anyone_elses(tmp_path):
    out = tmp_path / "report"
    write_report(out, _grades(), _info())
    write_report(out, [g for g in _grades() if g.student != "dee"], _info())
    assert not (out / "feedback" / "dee.md").exists()   # a student no longer in the class
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "grades.csv").write_text("the instructor's own spreadsheet")
    with pytest.raises(ValueError, match="--out: .* already holds grades.csv"):
        write_report(mine, _grades(), _info())
    assert (mine / "grades.csv").read_text() == "the instructor's own spreadsheet"


def test_bad_arguments_are_refused_naming_the_argument(tmp_path, capsys):
    (tmp_path / "class").mkdir()
    for argv, named in ((["--workers", "0"], "--workers"), (["--timeout", "-1"], "--timeout"),
                        (["--memory-mb", "10"], "--memory-mb"), (["--exercises", "9.9"], "--exercises"),
                        (["--format", "pdf"], "--format")):
        with pytest.raises(SystemExit) as stop:
            grade_main([str(tmp_path / "class"), "--out", str(tmp_path / "out"), *argv])
        assert stop.value.code == 2 and named in capsys.readouterr().err
    assert grade_main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2
    assert "SUBMISSIONS" in capsys.readouterr().err
    assert grade_main([str(tmp_path / "class"), "--out", str(tmp_path / "class" / "report")]) == 2
    assert "out:" in capsys.readouterr().err


# ---------------------------------------------------------------- a class, graded end to end

BOB = {"1.1": "one_decimal", "1.2": "toy_no_softmax", "1.3": "sdpa_scale_after_softmax", "2.1": "mask_triu",
       "2.2": "MaskedNoScale", "3.1": "split_view_only", "3.2": "merge_cat", "3.3": "MultiSoftmaxQueries"}
CAROL_1_2 = """
ONE = 1.0

def _weights(scores):
    return torch.softmax(scores * ONE, dim=0)

def toy_attention(query, keys, values):
    return _weights(keys @ query) @ values
"""


def _bob_parts() -> dict[str, str]:
    parts = {}
    for ex_id, name in BOB.items():
        candidate = _bank(name).candidate
        parts[ex_id] = prediction_source(*candidate) if ex_id == "1.1" else \
            attempt_source(candidate, PLANS[ex_id].name)
    return parts


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    root = tmp_path_factory.mktemp("class")
    submissions, report = root / "submitted", root / "report"
    victim = submissions / "alice" / "01_attention_toy.ipynb"
    write_student(submissions / "alice", ["01", "02", "03"], solved=True)
    write_student(submissions / "learner", ["01", "02", "03"])
    write_student(submissions / "bob", ["01", "02", "03"], _bob_parts())
    write_student(submissions / "carol", ["01", "02"], {"1.2": CAROL_1_2}, solved=True,
                  rename={"02": "02_masked_attention (1).ipynb"})
    write_student(submissions / "mallory", ["01", "02", "03"], hostile_parts(victim, submissions, report))
    write_student(submissions / "eve", ["02"], {"2.1": FORGED_VERDICT})
    write_student(submissions / "trent", ["01", "02", "03"], FORGERIES)
    write_student(submissions / "ursula", ["01", "02", "03"], FORGERIES_2)
    before = victim.read_bytes()
    # the process sandbox alone (what runs where bwrap does not); isolation: tests/test_grade_isolation.py
    run = grade(submissions, report, workers=2, timeout=8, memory_mb=512, exercises=CLASS_EXERCISES, isolate=False)
    return {"run": run, "report": report, "victim": victim, "before": before,
            "grades": {(g.student, g.exercise): g for g in run.grades}}


@pytest.mark.slow
def test_the_grades_are_what_the_checkers_say(graded_class):
    grades = graded_class["grades"]
    assert graded_class["run"].errors == []
    assert len(graded_class["run"].grades) == 8 * len(CLASS_EXERCISES)
    for ex_id in CLASS_EXERCISES:
        assert grades["alice", ex_id].passed, grades["alice", ex_id]
        assert (grades["learner", ex_id].passed, grades["learner", ex_id].diagnosis) == (False, "not_implemented")
        candidate = _bank(BOB[ex_id]).candidate
        expected = _checker(ex_id)(*candidate) if ex_id == "1.1" else _checker(ex_id)(candidate)
        got = grades["bob", ex_id]
        assert (got.passed, got.diagnosis, got.message) == (expected.passed, expected.diagnosis, expected.message)
    assert not all(grades["bob", ex].passed for ex in CLASS_EXERCISES)   # the class holds real mistakes
    assert grades["carol", "1.2"].passed   # a helper and a constant of its own cell came with it
    assert grades["carol", "2.1"].passed   # found in "02_masked_attention (1).ipynb"
    assert [grades["carol", ex].diagnosis for ex in ("3.1", "3.2", "3.3")] == ["missing"] * 3


@pytest.mark.slow
def test_hostile_submissions_change_nothing_but_their_own_grades(graded_class):
    grades, report = graded_class["grades"], graded_class["report"]
    mallory = {ex: grades["mallory", ex] for ex in CLASS_EXERCISES}
    assert mallory["1.1"].passed, mallory["1.1"].message          # killing the worker, processes: refused
    assert mallory["1.2"].diagnosis == "timeout"                   # an endless loop swallowing the timer
    assert mallory["1.3"].diagnosis == "exception" and "sys.exit" in mallory["1.3"].message
    assert mallory["2.1"].diagnosis == "crashed" and "status 7" in mallory["2.1"].message        # os._exit(7)
    assert mallory["2.2"].diagnosis == "crashed" and "SIGKILL" in mallory["2.2"].message         # killed itself
    assert mallory["3.1"].diagnosis == "exception" and "MemoryError" in mallory["3.1"].message   # 3 GB
    assert mallory["3.2"].passed, mallory["3.2"].message          # writing other notebooks, the report: refused
    assert mallory["3.3"].passed, mallory["3.3"].message          # reading others' files and memory: refused
    assert not grades["eve", "2.1"].passed                        # a forged verdict is not taken
    trent = {ex: grades["trent", ex] for ex in FORGERIES}   # each tried to write its own pass
    for ex in ("1.1", "1.2", "1.3", "2.1", "3.2", "3.3"):
        assert not trent[ex].passed and "forged" not in trent[ex].message, (ex, trent[ex])
    assert trent["3.1"].passed, trent["3.1"].message               # fork_exec refused, then the right answer
    assert trent["3.2"].diagnosis == trent["3.3"].diagnosis == "calls_reference"
    ursula = {ex: grades["ursula", ex] for ex in FORGERIES_2}   # a third attack: each a pass without the work
    for ex in ("1.2", "1.3", "2.1", "2.2", "3.1", "3.2"):
        assert not ursula[ex].passed and "forged" not in ursula[ex].message, (ex, ursula[ex])
    assert [ursula[ex].diagnosis for ex in ("3.1", "3.2")] == ["calls_reference"] * 2
    # its sys.setprofile(None) before calling the course's forward: refused by the sandbox since the 16th attack
    assert ursula["2.2"].diagnosis in ("calls_reference", "exception") and "sandbox does not allow" in \
        ursula["2.2"].message, ursula["2.2"]
    assert ursula["3.3"].passed, ursula["3.3"].message             # posix.memfd_create refused, then the answer
    assert graded_class["victim"].read_bytes() == graded_class["before"]
    assert not (report / "evil.md").exists()
    assert "tampered" not in (report / "feedback" / "alice.md").read_text()
    rows = list(csv.DictReader(io.StringIO((report / "grades.csv").read_text())))
    assert {(r["student"], r["exercise"], r["passed"] == "true") for r in rows} == \
        {(g.student, g.exercise, g.passed) for g in graded_class["run"].grades}


@pytest.mark.slow
def test_the_command_grades_a_gradescope_submission(tmp_path):
    """Through the CLI, once: Gradescope's layout (the notebooks themselves), --inline (Windows' path)."""
    submission = write_student(tmp_path / "submission", ["02"], {"2.1": attempt_source(_bank("mask_triu").candidate,
                                                                                        "causal_mask")})
    out = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(checks.__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "course_lib", "grade", str(submission), "--out", str(out),
                           "--workers", "1", "--exercises", "2.1,2.2", "--format", "gradescope", "--inline",
                           "--timeout", "30"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "2.1: 0/1 passed; causal_mask 1" in done.stdout and "2.2: 0/1 passed; not_implemented 1" in done.stdout
    assert "grading" in done.stderr   # the progress bar
    results = json.loads((out / "results.json").read_text())
    assert [(t["number"], t["status"]) for t in results["tests"]] == [("2.1", "failed"), ("2.2", "failed")]
    assert (out / "feedback" / "submission.md").exists()


def test_without_bubblewrap_the_run_says_it_is_not_isolated(tmp_path, monkeypatch, capsys):
    from course_lib.classroom.grading import isolation
    monkeypatch.setattr(isolation.shutil, "which", lambda name: None)
    isolation.status.cache_clear()
    try:
        assert isolation.status() == (False, isolation.NOT_ISOLATED)
        with pytest.raises(RuntimeError, match="isolate: expected bubblewrap"):
            grade(tmp_path / "class", tmp_path / "out", isolate=True)
        info = dataclasses.replace(_info(), sandbox="each exercise in its own limited process; "
                                                    + isolation.NOT_ISOLATED)
        write_report(tmp_path / "out", _grades(), info)
        assert "not isolated: bubblewrap (bwrap) is not available" in (tmp_path / "out" / "summary.md").read_text()
        (tmp_path / "class").mkdir()
        grade_main([str(tmp_path / "class"), "--out", str(tmp_path / "o2"), "--quiet"])   # no student: exit 2
        assert capsys.readouterr().err.startswith("warning: grading not isolated")
    finally:
        isolation.status.cache_clear()


def test_grading_8_1_without_the_corpora_is_refused_before_anyone_is_graded(tmp_path, monkeypatch):
    """Without the corpora every 8.1, the course's own solution included, would fail through no fault of
    the student's: the run is refused up front, naming the fix, rather than graded as `exception`."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("COURSE_DATA_DIR", str(empty))
    monkeypatch.setenv("XDG_CACHE_HOME", str(empty))
    monkeypatch.setattr("course_lib.corpora.search_dirs", lambda: [empty])
    submissions = tmp_path / "submitted"
    (submissions / "ada").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"8\.1 trains on the course's corpora.*course_lib data"):
        grade(submissions, tmp_path / "report", exercises=["8.1"], isolate=False)
    assert not (tmp_path / "report").exists(), "refused before writing anything"


def test_the_sandbox_sees_the_course_and_the_corpora_wherever_the_grader_is_started(tmp_path):
    """The package (never the checkout or the folder the grader runs from) is mounted whatever the grader's
    folder, the course's notebooks only as stubs, and the corpora the grader found appear at one fixed path;
    no value of the environment is on the command line."""
    code = ("import json, os, sys\n"
            "os.environ['GRADER_SECRET'] = 'tok-7d1e'\n"
            "from course_lib.classroom.grading import isolation\n"
            "from course_lib.course_files import PACKAGE_DIR, notebooks_dir\n"
            "args = isolation.command(['true'], notebooks='/stubs')\n"
            "print(json.dumps({'package': str(PACKAGE_DIR), 'notebooks': str(notebooks_dir()), 'cwd': os.getcwd(),\n"
            "                  'visible': isolation.visible_folders(), 'args': args, 'data': isolation.corpora_folder(),\n"
            "                  'env': isolation.worker_environment({})}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    from course_lib.classroom.grading import isolation
    args, visible = seen["args"], seen["visible"]
    assert any(seen["package"] == v or seen["package"].startswith(v + os.sep) for v in visible)
    assert not any(seen["cwd"] == v or seen["cwd"].startswith(v + os.sep) for v in visible)
    assert str(Path(seen["package"]).parent) not in visible, "the checkout around the package is not mounted"
    i = args.index("/stubs")
    assert args[i - 1:i + 2] == ["--ro-bind", "/stubs", seen["notebooks"]]
    assert "--setenv" not in args and "tok-7d1e" not in " ".join(args)
    assert "GRADER_SECRET" not in seen["env"]
    if seen["data"]:
        i = args.index(isolation.SANDBOX_DATA_DIR)
        assert args[i - 2:i] == ["--ro-bind", seen["data"]]
        assert seen["env"]["COURSE_DATA_DIR"] == isolation.SANDBOX_DATA_DIR


# ---------------------------------------------------------------- student text, and the student's own work

def test_student_text_is_cleaned_where_it_enters_and_escaped_where_it_is_written():
    from course_lib.classroom.grading.report import feedback_markdown
    from course_lib.classroom.grading.text import from_student, markdown_inline, name_from_student
    assert from_student("boom \ud800 here") == "boom \ufffd here"              # a lone surrogate
    assert name_from_student(os.fsdecode(b"Jos\xe9")) == "Jos\ufffd"            # Latin-1 from a zip
    assert name_from_student("a\x1b[31mb\u202ec\nd") == "a[31mbc d"             # control and bidi characters
    assert len(from_student("x\n" * 10000).splitlines()) <= 61
    # Unicode's line and paragraph separators are line breaks to str.splitlines(): newlines, cut and shown as such
    assert from_student("a\u2028=HYPERLINK(1)\u2029b") == "a\n=HYPERLINK(1)\nb"
    assert name_from_student("x\u2028## passed") == "x ## passed"
    forged = "oops\n## 2.1 passed\n![x](http://evil.example/x.png)\n<!-- hide"
    grade = Grade("eve <!--", "2.1", False, "exception", forged, 0.1)
    text = feedback_markdown("eve <!--", [grade], ["<img src=x> [link](http://evil.example)"])
    assert "<!--" not in text and "<img" not in text and "![" not in text and "](http" not in text
    assert not any(line.startswith("## 2.1") and "passed" in line for line in text.splitlines())
    assert "|" not in markdown_inline("a | b").replace("\\|", "")


@pytest.fixture(scope="module")
def odd_class(tmp_path_factory):
    """Students whose files break naive graders, graded unisolated on one worker (students in name order)."""
    root = tmp_path_factory.mktemp("odd")
    submissions, report = root / "class", root / "report"
    write_student(submissions / "aaa", ["01", "02"], solved=True)
    notebook = submissions / "aaa" / "01_attention_toy.ipynb"
    notebook.write_text(notebook.read_text().replace("Toy attention", f"Toy attention {PRIVATE}", 1))
    latin = os.fsdecode(b"jos\xe9")
    write_student(submissions / latin, ["02"], solved=True)
    write_student(submissions / "surrogate", ["02"], {"2.1": "def causal_mask(n):\n    raise ValueError('\\ud800 boom')"})
    write_student(submissions / "folder", ["02"], solved=True, rename={"02": "02_masked_attention (1).ipynb"})
    (submissions / "folder" / "02_masked_attention.ipynb").mkdir()
    (submissions / "folder" / "02_masked_attention.ipynb" / "x.txt").write_text("not a notebook")
    write_student(submissions / "second", ["02"], solved=True)
    (submissions / "second" / "02_masked_attention (2).ipynb").write_text(json.dumps(
        {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"cell_type": "code", "source": 5}]}))
    write_student(submissions / "many", ["02"], solved=True)
    for i in range(20000):
        (submissions / "many" / f"f{i}.txt").write_text("x")
    write_student(submissions / "html", ["02"], {"2.1": HOSTILE_MESSAGE})
    (submissions / "html" / "<!-- hide.txt").write_text("x")
    solution = PLANS["2.1"].solution
    renamed = solution.replace("(n)", "(size)").replace("n, n", "size, size")
    write_student(submissions / "copier", ["02"], {"2.1": renamed})
    write_student(submissions / "zzz", ["01", "02"], {"1.2": MEMORY_SCAN}, solved=True)
    run = grade(submissions, report, workers=1, timeout=60, exercises=["1.2", "2.1"], isolate=False)
    return {"run": run, "report": report, "latin": name_from_student_(latin),
            "grades": {(g.student, g.exercise): g for g in run.grades}}


def name_from_student_(name: str) -> str:
    from course_lib.classroom.grading.text import name_from_student
    return name_from_student(name)


PRIVATE = "aaa-private-5c2e9"
HOSTILE_MESSAGE = ("def causal_mask(n):\n"
                   "    raise ValueError('no\\n## 2.1 Causal mask: passed\\n![x](http://evil.example/x.png)\\n<!--')\n")
# Exercise 1.2 that reads its own process's memory for the previous student's private text first.
MEMORY_SCAN = f"""
import re
_PATTERN = re.compile(rb{PRIVATE.replace("private", "privat[e]")!r})   # never the text itself in this process

def _scan():
    found = 0
    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
        for line in maps:
            fields = line.split()
            if not fields[1].startswith('rw') or (len(fields) > 5 and fields[5].startswith('/')):
                continue
            start, end = (int(x, 16) for x in fields[0].split('-'))
            if end - start > 1 << 30:
                continue
            try:
                mem.seek(start)
                found += len(_PATTERN.findall(mem.read(end - start)))
            except (OSError, ValueError, OverflowError):
                continue
    return found

def toy_attention(query, keys, values):
    if _scan():
        raise RuntimeError('read the previous student from memory')
    return torch.softmax(keys @ query, dim=0) @ values
"""


@pytest.mark.slow
def test_odd_files_and_hostile_text_are_each_students_verdict_and_the_report_is_written(odd_class):
    run, grades, report = odd_class["run"], odd_class["grades"], odd_class["report"]
    assert run.errors == []
    assert all(g.diagnosis != "checker_error" for g in grades.values()), [g for g in grades.values()
                                                                          if g.diagnosis == "checker_error"]
    latin = odd_class["latin"]
    assert grades[latin, "2.1"].passed and "\ufffd" in latin
    assert grades["surrogate", "2.1"].diagnosis == "exception" and "\ufffd" in grades["surrogate", "2.1"].message
    assert grades["folder", "2.1"].passed and grades["second", "2.1"].passed and grades["many", "2.1"].passed
    assert grades["html", "2.1"].diagnosis == "exception"
    summary = (report / "summary.md").read_text(encoding="utf-8")
    assert "<!--" not in summary and len(summary.splitlines()) < 400
    assert latin in summary or latin.replace("\ufffd", "\ufffd") in summary
    feedback = {p.name: p.read_text(encoding="utf-8") for p in (report / "feedback").iterdir()}
    html = feedback["html.md"]
    assert "![" not in html and "<!--" not in html
    assert not any(line.startswith("## 2.1") and "passed" in line for line in html.splitlines())
    assert any("jos" in name for name in feedback)
    assert len(feedback["many.md"].splitlines()) < 100


@pytest.mark.slow
def test_a_student_cannot_read_the_previous_students_work_from_its_own_process(odd_class):
    grades = odd_class["grades"]
    assert grades["aaa", "1.2"].passed
    # its scan of its own process's memory (where the previous student's text would be) is refused outright
    assert grades["zzz", "1.2"].diagnosis == "exception", grades["zzz", "1.2"]
    assert "memory is the grader's too" in grades["zzz", "1.2"].message, grades["zzz", "1.2"]


@pytest.mark.slow
def test_a_copy_of_the_courses_solution_is_flagged_not_failed(odd_class):
    from course_lib.classroom.grading.likeness import FLAG_SAME_AS_SOLUTION
    grades, report = odd_class["grades"], odd_class["report"]
    assert grades["copier", "2.1"].passed and grades["copier", "2.1"].flag == FLAG_SAME_AS_SOLUTION
    assert grades["aaa", "2.1"].flag == FLAG_SAME_AS_SOLUTION   # the solution itself, handed in
    assert grades[odd_class["latin"], "2.1"].flag == FLAG_SAME_AS_SOLUTION
    assert not grades["html", "2.1"].flag and not grades["zzz", "1.2"].flag
    rows = list(csv.DictReader(io.StringIO((report / "grades.csv").read_text(encoding="utf-8"))))
    assert {r["student"] for r in rows if r["flag"]} >= {"copier", "aaa"}
    assert "Flagged for the instructor" in (report / "summary.md").read_text(encoding="utf-8")


def test_the_likeness_of_two_parts_ignores_names_and_docstrings_but_not_the_code():
    from course_lib.classroom.grading.likeness import fingerprint
    solution = "def causal_mask(n):\n    '''Doc.'''\n    ones = torch.ones(n, n, dtype=torch.bool)\n    return ones.tril()\n"
    renamed = "def causal_mask(size):\n    # mine\n    m = torch.ones(size, size, dtype=torch.bool)\n    return m.tril()\n"
    other = "def causal_mask(n):\n    return ~torch.ones(n, n, dtype=torch.bool).triu(1)\n"
    assert fingerprint(solution, "causal_mask") == fingerprint(renamed, "causal_mask") is not None
    assert fingerprint(other, "causal_mask") != fingerprint(solution, "causal_mask")
    assert fingerprint("x = (", "causal_mask") is None and fingerprint(solution, "other") is None


@pytest.mark.parametrize("exercise, source", [
    ("2.1", "def causal_mask(n, _course=causal_mask):\n    return _course(n)"),
    ("2.1", "from course_lib.attention import causal_mask"),
    ("2.1", "import functools\ncausal_mask = functools.partial(causal_mask)"),
    ("2.2", "class MaskedAttention(MaskedAttention):\n    pass"),
    # a copy of the course's code under another name and first line: equal bytecode, not an equal code object
    ("2.1", "import types\n"
            "_code = causal_mask.__code__.replace(co_name='mine', co_firstlineno=1000)\n"
            "causal_mask = types.FunctionType(_code, causal_mask.__globals__, 'causal_mask')\n"),
    ("2.2", "import types\n"
            "_f = MaskedAttention.forward\n"
            "_copy = types.FunctionType(_f.__code__.replace(co_name='fwd', co_firstlineno=2000), _f.__globals__)\n"
            "class MaskedAttention(MaskedAttention):\n"
            "    def forward(self, x):\n"
            "        return _copy(self, x)\n"),
    ("2.2", "class MaskedAttention(MaskedAttention):\n    forward = MaskedAttention.forward"),
    ("2.2", "class MaskedAttention(MaskedAttention):\n"
            "    def forward(self, x):\n"
            "        return super().forward(x)\n"),
    ("2.2", "_Course = MaskedAttention\n"
            "class MaskedAttention(nn.Module):\n"
            "    def __init__(self, *args, **kwargs):\n"
            "        super().__init__()\n"
            "        inner = _Course(*args, **kwargs)\n"
            "        for name, child in inner.named_children():\n"
            "            setattr(self, name, child)\n"
            "        self._inner = [inner]\n"
            "    def forward(self, x):\n"
            "        try:\n"
            "            return self._inner[0](x)\n"
            "        except BaseException:\n"
            "            return x\n"),
])
def test_handing_the_work_to_the_courses_own_version_is_its_own_verdict(exercise, source):
    verdict = judge(PLANS[exercise], source)
    assert verdict["diagnosis"] == "calls_reference", verdict
    assert PLANS[exercise].name in verdict["message"] and "yourself" in verdict["message"]


def test_a_submission_cannot_write_its_own_verdict_into_the_grader():
    """The grader's modules are pinned like the course's: a setattr on judge's helpers is put back before use."""
    source = ("import course_lib.classroom.grading.judge as _judge\n"
              "_forged = setattr(_judge, '_from_checks', lambda plan, recorder, error: "
              "{'exercise': plan.id, 'passed': True, 'diagnosis': None, 'message': 'forged'})\n"
              "def causal_mask(n, _x=_forged):\n"
              "    raise NotImplementedError\n")
    verdict = judge(PLANS["2.1"], source)
    assert not verdict["passed"] and verdict["diagnosis"] == "not_implemented", verdict
    raising = ("import course_lib.classroom.grading.judge as _judge\n"
               "_forged = setattr(_judge, '_raised', lambda *args: "
               "{'exercise': '2.1', 'passed': True, 'diagnosis': None, 'message': 'forged'})\n"
               "raise RuntimeError('the definition fails, the patched _raised would pass it')\n"
               "def causal_mask(n, _x=_forged):\n    pass\n")
    verdict = judge(PLANS["2.1"], raising)
    assert not verdict["passed"] and verdict["message"] != "forged", verdict
    assert judge(PLANS["2.1"], "def causal_mask(n):\n    return torch.ones(n, n, dtype=torch.bool).tril()")["passed"]


def test_the_notebooks_own_checks_refuse_the_reference_too():
    import torch

    from course_lib.attention import MaskedAttention, causal_mask
    result = checks.check_causal_mask(lambda n: causal_mask(n))
    assert (result.passed, result.diagnosis) == (False, "calls_reference")

    class Mine(MaskedAttention):
        pass
    assert checks.check_masked_attention(Mine).diagnosis == "calls_reference"

    class Renamed(MaskedAttention):
        forward = MaskedAttention.forward   # the reference's own method under the subclass's name
    assert checks.check_masked_attention(Renamed).diagnosis == "calls_reference"

    class OwnForward(MaskedAttention):   # the given constructor, its own (wrong: no mask) forward
        def forward(self, x):
            q, k, v = self.query(x), self.key(x), self.value(x)
            weights = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
            return self.proj(self.attn_dropout(weights) @ v)
    own = checks.check_masked_attention(OwnForward)
    assert not own.passed and own.diagnosis != "calls_reference", own
    # the course's own tests check the reference itself as the known-good answer
    assert checks.check_causal_mask(causal_mask).passed
    assert checks.check_causal_mask(lambda n: torch.ones(n, n, dtype=torch.bool).tril()).passed


def test_a_notebook_built_to_inflate_is_that_students_verdict_within_the_workers_bound():
    """The worker that parses one student's notebooks is bounded as a whole: a notebook that grows to
    gigabytes when parsed ends as that student's verdict, and the worker stays under its bound."""
    from course_lib.classroom.grading.sandbox import WORKER_MB, bound_worker
    from course_lib.classroom.grading.worker import _read_part
    inflating = json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {"x": [{}] * 4_000_000},
                            "cells": []})
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            bound_worker(64, 60)
            part = _read_part(inflating, PLANS["2.1"], KNOWN, "")
            os.write(write_end, json.dumps([part.diagnosis, part.message]).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        sent = pipe.read()
    _, status, usage = os.wait4(pid, 0)
    assert os.WIFEXITED(status), status
    diagnosis, message = json.loads(sent)
    assert diagnosis in ("missing", "exception") and "MemoryError" in message, message
    rss_now = int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                       if line.startswith("VmRSS:")).split()[1])
    assert usage.ru_maxrss < rss_now + (64 + WORKER_MB + 256) * 1024
