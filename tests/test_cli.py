"""`python -m course_lib ...` behaves for a newcomer: clear verdicts, clear errors."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course_lib.__main__ import main
from course_lib.classroom.doctor import run_doctor

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_doctor_is_ready_with_the_corpora(monkeypatch, capsys):
    assert SHARED.is_dir(), f"expected the shared corpora at {SHARED}"
    monkeypatch.setenv("COURSE_DATA_DIR", str(SHARED))
    monkeypatch.setattr("course_lib.classroom.doctor._kernel_python", lambda: (sys.executable, ""))
    assert run_doctor() == 0
    out = capsys.readouterr().out
    assert "READY" in out and "tinyshakespeare" in out and "checksum OK" in out
    assert f"1. {SHARED}  (COURSE_DATA_DIR)" in out, "doctor prints the search order"
    assert f"{SHARED / 'names.txt'} (checksum OK)" in out, "and where each corpus was found"


def test_doctor_says_what_to_run_when_a_corpus_is_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path))
    monkeypatch.setattr("course_lib.corpora.REPO_DATA_DIR", tmp_path / "nothing-here")
    monkeypatch.setattr("course_lib.classroom.doctor._kernel_python", lambda: (None, "Jupyter here has no 'python3' kernel"))
    assert run_doctor() == 1
    out = capsys.readouterr().out
    assert "NOT READY" in out and "python -m course_lib data" in out and "make lab" in out
    assert f"copy names.txt into {tmp_path}" in out


def test_doctor_tells_when_the_kernel_cannot_import_course_lib(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("COURSE_DATA_DIR", str(SHARED))
    elsewhere = tmp_path / "python"
    elsewhere.write_text("#!/bin/sh\nexit 1\n")   # a Python without the course: its import fails
    elsewhere.chmod(0o755)
    monkeypatch.setattr("course_lib.classroom.doctor._kernel_python", lambda: (str(elsewhere), ""))
    assert run_doctor() == 1
    out = capsys.readouterr().out
    assert f"{elsewhere} CANNOT IMPORT course_lib" in out and "make lab" in out


def test_the_kernel_doctor_finds_here_is_this_environments_python(capsys):
    from course_lib.classroom.doctor import _kernel_python
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


# ---------------------------------------------------------------- train: checked first, stopped cleanly, resumed

TEXT = "hello world, hello attention. " * 100


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if a refused run starts training: every check must come before the first step."""
    def refuse(*args, **kwargs):
        raise AssertionError("training started before the arguments were checked")
    monkeypatch.setattr("course_lib.train.train", refuse)


@pytest.mark.parametrize("extra,message", [
    (["--out", "{file}"], "out: expected a folder for checkpoint.pt and metrics.json, got the existing file"),
    (["--out", "{file}/sub"], "out: expected a folder this process can write, got"),
    (["--out", "{run}", "--device", "cuda"], "device: 'cuda' asked for, but CUDA is not available here"),
    (["--out", "{run}", "--device", "tpu"], "device: expected 'cpu', 'cuda', 'cuda:N' or 'mps', got 'tpu'"),
    (["--out", "{run}", "--steps", "0"], "steps: expected a positive int, got 0"),
    (["--out", "{run}", "--seconds", "-1"], "seconds: expected a finite number > 0, got -1.0"),
    (["--out", "{run}", "--batch-size", "0"], "batch_size: expected a positive int, got 0"),
    (["--out", "{run}", "--corpus", "{missing}"], "missing.txt"),
    (["--resume", "{run}"], "resume: expected a run folder holding checkpoint.pt"),
    (["--out", "{run}", "--resume", "{run}"], "not allowed with argument"),
])
def test_a_bad_train_argument_is_one_line_and_status_2_before_any_training(
        extra, message, tmp_path, corpus, capsys, no_training):
    (tmp_path / "file").write_text("not a folder")
    names = dict(file=tmp_path / "file", run=tmp_path / "run", missing=tmp_path / "missing.txt")
    argv = ["train", "--preset", "tiny", "--corpus", str(corpus), "--quiet"] + [a.format(**names) for a in extra]
    if "--device" not in extra:
        argv += ["--device", "cpu"]
    with pytest.raises(SystemExit) if "not allowed" in message else _returns(2) as status:
        status.value = main(argv)
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err
    if "not allowed" not in message:   # argparse prints its usage; ours is one line
        assert len(err.splitlines()) == 1 and err.startswith("error: ")


class _returns:
    def __init__(self, expected):
        self.expected = expected

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        assert exc[0] is None and self.value == self.expected, (exc, getattr(self, "value", None))


def test_a_folder_holding_a_run_asks_for_resume_or_overwrite(tmp_path, corpus, capsys):
    argv = ["train", "--preset", "tiny", "--steps", "3", "--corpus", str(corpus), "--device", "cpu", "--quiet",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    before = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and f"--resume {tmp_path / 'run'}" in err and "--overwrite" in err
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == before   # untouched
    assert main(argv + ["--overwrite"]) == 0
    assert main(["train", "--resume", str(tmp_path / "run"), "--steps", "6", "--quiet"]) == 0
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 6


def test_bench_training_refuses_a_file_as_out_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("course_lib.runs.bench.measure_matmul_peak", lambda *a, **k: pytest.fail("measured first"))
    (tmp_path / "file").write_text("x")
    assert main(["bench", "training", "--seconds", "1", "--out", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out: expected a folder") and "Traceback" not in err


def _start_training(tmp_path, corpus, *extra):
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "course_lib", "train", "--preset", "tiny", "--steps", "100000", "--corpus",
         str(corpus), "--device", "cpu", "--quiet", "--out", str(out), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # wait for the first checkpoint (the evaluation at step 50): training is under way
    for _ in range(4800):   # up to 4 minutes on a loaded machine; usually 2-3 s
        if (out / "checkpoint.pt").exists() or process.poll() is not None:
            break
        time.sleep(0.05)
    return process, out


@pytest.mark.slow
@pytest.mark.parametrize("signum,status", [(15, 143), (2, 130)])
def test_sigterm_and_ctrl_c_stop_cleanly_with_a_loadable_checkpoint(tmp_path, corpus, signum, status):
    from course_lib.checkpoints import load_checkpoint
    process, out = _start_training(tmp_path, corpus)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == status, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    assert f"resume with: python -m course_lib train --resume {out}" in stderr
    saved = load_checkpoint(out / "checkpoint.pt")
    metrics = json.loads((out / "metrics.json").read_text())
    step = saved.training["step"]
    assert f"stopped at step {step} " in stderr and step >= 1
    assert metrics["status"] == "stopped" and metrics["step"] == step and metrics["run_id"] == saved.training["run_id"]
    assert sorted(p.name for p in out.iterdir()) == [".course_lib-run.lock", "checkpoint.pt", "metrics.json"]   # no temporaries
    assert main(["train", "--resume", str(out), "--steps", str(step + 5), "--quiet"]) == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == step + 5


def test_a_refused_overwrite_keeps_the_old_run(tmp_path, corpus, capsys):
    out = str(tmp_path / "run")
    assert main(["train", "--preset", "tiny", "--steps", "3", "--corpus", str(corpus), "--device", "cpu",
                 "--quiet", "--out", out]) == 0
    before = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    assert main(["train", "--preset", "tiny", "--steps", "3", "--corpus", str(tmp_path / "missing.txt"),
                 "--device", "cpu", "--quiet", "--out", out, "--overwrite"]) == 2
    assert "missing.txt" in capsys.readouterr().err
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == before


def test_start_on_a_symlink_loop_and_progress_watch_inf_are_clear_errors(tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for target in (loop, loop / "deeper"):
        assert main(["start", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Symlink loop" in err and "Traceback" not in err
    for value in ("inf", "nan", "1e300"):
        with pytest.raises(SystemExit) as exit_:
            main(["progress", "--watch", value, str(tmp_path)])
        assert exit_.value.code == 2
        assert "--watch: expected a number of seconds > 0 and at most 86400" in capsys.readouterr().err


@pytest.mark.parametrize("command,usage", [("start", "start [-h] [dir]"), ("student", "student [-h] src out"),
                                           ("bench", "{training,attention,ablation,nanogpt,triton,generate}")])
def test_each_subcommand_shows_its_own_usage(command, usage, capsys):
    """--help reaches the subcommand's own parser (it printed only 'args' before)."""
    try:
        code = main([command, "--help"])
    except SystemExit as done:   # argparse's own exit, where the subcommand lets it through
        code = done.code
    assert code == 0
    assert usage in " ".join(capsys.readouterr().out.split())



def test_grades_help_names_every_column_of_grades_csv(capsys):
    from course_lib.classroom.grading.report import COLUMNS
    with pytest.raises(SystemExit):
        main(["grade", "--help"])
    assert ", ".join(COLUMNS) in " ".join(capsys.readouterr().out.split())
