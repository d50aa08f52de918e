"""What a second scripted fault run found (2026-11-29), in the instructor's and maintainer's commands: students
left out without a word, two grading runs in one report folder, a stub grades.csv read as an empty class,
tracebacks for wrong arguments, and a benchmark that went on after Ctrl-C."""
from __future__ import annotations

import csv
import io
import os

import pytest
from synthetic_class import write_student

from course_lib.__main__ import main
from course_lib.classroom.grading import report
from course_lib.classroom.grading.submissions import find_submissions


def test_the_stub_grades_csv_of_a_killed_swap_fails_a_reader_of_the_grades(tmp_path):
    report._stubs(tmp_path, {"grades.csv"})
    text = (tmp_path / "grades.csv").read_text()
    assert report.INCOMPLETE in text.splitlines()[0]
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rows, "an empty table reads as a class with no students"
    with pytest.raises(KeyError):
        [row["student"] for row in rows]


def test_a_report_folder_another_run_holds_is_refused_naming_it(tmp_path):
    out = tmp_path / "report"
    held = report.hold_report_folder(out)
    try:
        with pytest.raises(RuntimeError, match=rf"another grade run \(PID {os.getpid()}, started "):
            report.hold_report_folder(out)
    finally:
        report.release_report_folder(held)
    report.release_report_folder(report.hold_report_folder(out))   # free again once the first run ends


def test_links_in_a_class_folder_are_followed_to_students_and_named_inside_a_submission(tmp_path):
    homes, klass = tmp_path / "homes", tmp_path / "class"
    write_student(homes / "ann", ["01"], solved=True)
    write_student(klass / "ben", ["01", "02"], solved=True)
    klass.joinpath("ann").symlink_to(homes / "ann")                    # a JupyterHub's class of links
    notebook = klass / "ben" / "02_masked_attention.ipynb"
    notebook.rename(tmp_path / "elsewhere.ipynb")
    notebook.symlink_to(tmp_path / "elsewhere.ipynb")                  # a notebook that is a link
    (klass / "ben" / "03_multi_head_attention.ipynb").mkdir()          # a notebook that is a folder
    os.mkfifo(klass / "ben" / "04_transformer_blocks.ipynb")           # one that would block a reader
    found = {s.student: s for s in find_submissions(klass)}
    assert set(found) == {"ann", "ben"}
    assert "01_attention_toy.ipynb" in found["ann"].files
    notes = " ".join(found["ben"].notes)
    assert "02_masked_attention.ipynb skipped: a link" in notes
    assert "03_multi_head_attention.ipynb is a folder, not a notebook" in notes
    assert "04_transformer_blocks.ipynb skipped: not a regular file" in notes


@pytest.mark.parametrize("argv", [["data", "nosuchcorpus"], ["data", ""],
                                  ["bench", "attention", "--lengths", "0"], ["bench", "attention", "--repeats", "0"],
                                  ["bench", "attention", "--embed-dim", "7", "--heads", "3"],
                                  ["bench", "generate", "--new-tokens", "0"], ["progress", ""]])
def test_a_wrong_argument_is_one_line_not_a_traceback(argv, capsys):
    assert main(argv) in (1, 2)
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_autograder_refuses_the_memory_grade_refuses(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["autograder", str(tmp_path / "a.zip"), "--memory-mb", "10"])
    assert exited.value.code == 2 and "64 or more" in capsys.readouterr().err


def test_a_report_folder_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    write_student(tmp_path / "class" / "ann", ["01"], solved=True)

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "report"))
    monkeypatch.setattr("course_lib.classroom.grading.report.hold_report_folder", refused)
    monkeypatch.setattr("course_lib.classroom.grading.hold_report_folder", refused)
    assert main(["grade", str(tmp_path / "class"), "--out", str(tmp_path / "report"), "--isolation", "off",
                 "--exercises", "1.1"]) == 2
    err = capsys.readouterr().err
    assert "out: could not write the report" in err and "Traceback" not in err


def test_ctrl_c_during_bench_training_stops_the_benchmark(monkeypatch, capsys):
    calls = []

    def stopped(name, out, **kwargs):
        calls.append(name)
        return {"status": "stopped", "signal": "SIGINT"}
    monkeypatch.setattr("course_lib.runs.bench.run_preset", stopped)
    monkeypatch.setattr("course_lib.runs.bench.measure_matmul_peak", lambda *a, **k: 100.0)
    assert main(["bench", "training", "--steps", "2", "--presets", "baseline_cpu", "shakespeare_char_cpu"]) == 130
    assert calls == ["baseline_cpu"] and "interrupted" in capsys.readouterr().err


def test_a_timeout_the_courses_own_solutions_cannot_meet_is_refused_before_grading(tmp_path, capsys):
    write_student(tmp_path / "class" / "ann", ["01"], solved=True)
    assert main(["grade", str(tmp_path / "class"), "--out", str(tmp_path / "report"), "--isolation", "off",
                 "--exercises", "1.1,1.2", "--timeout", "0.001", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "the limits given are too tight" in err and "give a larger --timeout" in err
    assert not (tmp_path / "report" / "grades.csv").exists()   # nobody graded, every student told to look for a loop


def _written_report(out):
    """A report as a finished run leaves it: its marker lists the files it wrote in feedback/."""
    from course_lib.classroom.grading.grades import Grade
    info = report.RunInfo(students=1, workers=1, timeout=60, memory_mb=2048, seconds=1.0, sandbox="test")
    report.claim_report_folder(out)
    report.write_report(out, [Grade("ann", "1.1", True, None, "Right.", 0.1)], info)
    return info


def test_files_an_instructor_added_to_feedback_are_never_replaced_by_a_new_run(tmp_path):
    out = tmp_path / "report"
    _written_report(out)
    notes = out / "feedback" / "notes-for-ann.txt"
    notes.write_text("the instructor's own notes")
    with pytest.raises(ValueError, match="feedback/notes-for-ann.txt"):
        report.claim_report_folder(out)   # the next run: refused before anyone is graded
    assert notes.read_text() == "the instructor's own notes"
    notes.unlink()
    report.claim_report_folder(out)   # once moved out, the run goes ahead


def test_the_work_folder_a_killed_run_left_is_removed_by_the_next(tmp_path, monkeypatch):
    import tempfile
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    left = scratch / ".course-grade-work.pid999999999.abcdefgh.d"   # a pid no process has
    (left / "notebooks").mkdir(parents=True)
    os.utime(left, (0, 0))   # old: a folder of a process that is gone, not one being made now
    write_student(tmp_path / "class" / "ann", ["01"], solved=True)
    monkeypatch.setattr("course_lib.classroom.grading.grade_submissions", lambda *args: ([], []))   # no worker
    assert main(["grade", str(tmp_path / "class"), "--out", str(tmp_path / "report"), "--isolation", "off",
                 "--exercises", "1.1", "--quiet"]) == 0
    assert not left.exists() and not list(scratch.iterdir())   # and this run's own is gone too


def test_ctrl_c_during_export_is_one_line(tmp_path, monkeypatch, capsys):
    from course_lib.runs import export

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(export, "export_run", interrupted)
    assert export.main(str(tmp_path / "run"), str(tmp_path / "hf")) == 130
    assert capsys.readouterr().err.strip() == f"interrupted: nothing was written to {tmp_path / 'hf'}"


def test_a_full_disk_while_making_the_stubs_leaves_the_previous_report_and_its_marker(tmp_path, monkeypatch):
    import errno

    from course_lib.classroom.grading.grades import Grade
    out = tmp_path / "report"
    info = _written_report(out)
    before = (out / "grades.csv").read_text()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(report, "_stubs", full)
    with pytest.raises(OSError):
        report.write_report(out, [Grade("ann", "1.1", False, "shape", "Wrong.", 0.1)], info)
    assert (out / "grades.csv").read_text() == before
    assert report.report_state(out)[0] != "replacing"
    assert not [p for p in out.iterdir() if p.name.startswith(".course-grade-report.pid")]


def test_a_notebook_name_too_long_for_its_staged_copy_is_named(tmp_path, capsys):
    from course_lib.classroom.assignments import main as student_main
    source = tmp_path / "src"
    source.mkdir()
    long_name = "n" * (255 - len(".ipynb")) + ".ipynb"   # legal here; its staged copy's name is not
    (source / long_name).write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    assert student_main([str(source), str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert "name is too long" in err and "rename it shorter" in err and "Traceback" not in err
