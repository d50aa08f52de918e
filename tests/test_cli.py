"""`python -m course_lib ...` behaves for a newcomer: clear verdicts, clear errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.__main__ import main
from course_lib.doctor import run_doctor

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_doctor_is_ready_with_the_corpora(monkeypatch, capsys):
    assert SHARED.is_dir(), f"expected the shared corpora at {SHARED}"
    monkeypatch.setenv("COURSE_DATA_DIR", str(SHARED))
    monkeypatch.setattr("course_lib.doctor._kernel_python", lambda: (sys.executable, ""))
    assert run_doctor() == 0
    out = capsys.readouterr().out
    assert "READY" in out and "tinyshakespeare" in out and "checksum OK" in out
    assert f"1. {SHARED}  (COURSE_DATA_DIR)" in out, "doctor prints the search order"
    assert f"{SHARED / 'names.txt'} (checksum OK)" in out, "and where each corpus was found"


def test_doctor_says_what_to_run_when_a_corpus_is_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path))
    monkeypatch.setattr("course_lib.corpora.REPO_DATA_DIR", tmp_path / "nothing-here")
    monkeypatch.setattr("course_lib.doctor._kernel_python", lambda: (None, "Jupyter here has no 'python3' kernel"))
    assert run_doctor() == 1
    out = capsys.readouterr().out
    assert "NOT READY" in out and "python -m course_lib data" in out and "make lab" in out
    assert f"copy names.txt into {tmp_path}" in out


def test_doctor_tells_when_the_kernel_cannot_import_course_lib(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("COURSE_DATA_DIR", str(SHARED))
    elsewhere = tmp_path / "python"
    elsewhere.write_text("#!/bin/sh\nexit 1\n")   # a Python without the course: its import fails
    elsewhere.chmod(0o755)
    monkeypatch.setattr("course_lib.doctor._kernel_python", lambda: (str(elsewhere), ""))
    assert run_doctor() == 1
    out = capsys.readouterr().out
    assert f"{elsewhere} CANNOT IMPORT course_lib" in out and "make lab" in out


def test_the_kernel_doctor_finds_here_is_this_environments_python(capsys):
    from course_lib.doctor import _kernel_python
    python, why = _kernel_python()
    assert why == "" and Path(python).resolve() == Path(sys.executable).resolve()


def test_train_cli_writes_metrics(tmp_path, capsys):
    corpus = tmp_path / "text.txt"
    corpus.write_text("hello world, hello attention. " * 100)
    assert main(["train", "--preset", "tiny", "--steps", "5", "--corpus", str(corpus), "--device", "cpu",
                 "--quiet", "--out", str(tmp_path / "run")]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 5 and metrics["tokens_per_second"] > 0
    assert '"val_loss"' in capsys.readouterr().out


def test_unknown_preset_is_refused_with_the_choices():
    result = subprocess.run([sys.executable, "-m", "course_lib", "train", "--preset", "huge", "--out", "x"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "invalid choice: 'huge'" in result.stderr and "shakespeare_char_cpu" in result.stderr


def test_data_command_without_download_reports_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path))
    monkeypatch.setattr("course_lib.corpora.REPO_DATA_DIR", tmp_path / "nothing-here")
    assert main(["data", "names", "--no-download"]) == 1
    assert "names" in capsys.readouterr().err


def test_data_warn_only_lets_make_lab_open_offline(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path))
    monkeypatch.setattr("course_lib.corpora.REPO_DATA_DIR", tmp_path / "nothing-here")
    assert main(["data", "--no-download", "--warn-only"]) == 0
    err = capsys.readouterr().err
    assert "WARNING: names, tinyshakespeare not available yet" in err
    assert f"save it as {tmp_path / 'names.txt'}" in err, "the warning carries the exact fix"
    assert main(["data", "--no-download"]) == 1
