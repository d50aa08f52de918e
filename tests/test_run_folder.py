"""A run folder has one owner, and a run's end survives an interrupt (issue 27, sections 1 and 2)."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from course_lib.__main__ import main
from course_lib.runs.run_folder import RunFolder, RunRefused

LOCK = ".course_lib-run.lock"   # the file a run holds (course_lib.runs.run_folder.LOCK)

TEXT = "".join(f"line {i}: to be, or not to be, that is the question.\n" for i in range(60))
FAST = ["--preset", "tiny", "--device", "cpu", "--quiet"]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture
def holder(tmp_path):
    """Another process that holds tmp_path/run, as a live training run does."""
    run = tmp_path / "run"
    code = textwrap.dedent(f"""
        import time
        from course_lib.runs.run_folder import RunFolder
        folder = RunFolder({str(run)!r}, overwrite=True)
        folder.prepare()
        print("held", flush=True)
        time.sleep(120)
    """)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield process, run
    process.kill()
    process.wait()


def test_a_second_run_on_a_held_folder_is_refused_naming_the_holder(holder, corpus, capsys):
    process, run = holder
    # the live run's half-written checkpoint: a refused run must leave it alone
    partial = run / ".checkpoint.pt.k3j2.course_lib-partial"
    partial.write_bytes(b"half of a checkpoint")
    for extra in (["--out", str(run)], ["--out", str(run), "--overwrite"], ["--resume", str(run)]):
        (run / "checkpoint.pt").write_bytes(b"x") if "--resume" in extra else None
        assert main(["train", *FAST, "--steps", "2", "--corpus", str(corpus), *extra]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another run (PID {process.pid}, started 20" in err, err
        assert f"kill {process.pid}" in err and "Traceback" not in err
        assert partial.read_bytes() == b"half of a checkpoint"


def test_a_lock_left_by_a_dead_run_is_taken_over(holder, corpus, capsys):
    process, run = holder
    process.kill()
    process.wait()
    held = json.loads((run / LOCK).read_text())
    assert held["pid"] == process.pid   # the file still names the dead holder
    assert main(["train", *FAST, "--steps", "2", "--corpus", str(corpus), "--out", str(run), "--overwrite"]) == 0
    assert json.loads((run / "metrics.json").read_text())["status"] == "finished"
    # and the lock is let go when the run ends: the next run may take the folder
    folder = RunFolder(run, resume=True)
    folder.prepare()
    assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
    folder.release()


def test_the_lock_is_released_when_a_run_is_refused(tmp_path, corpus):
    run = tmp_path / "run"
    # refused after the lock was taken (the folder already holds a run): the next run is not blocked
    assert main(["train", *FAST, "--steps", "2", "--corpus", str(corpus), "--out", str(run)]) == 0
    assert main(["train", *FAST, "--steps", "2", "--corpus", str(corpus), "--out", str(run)]) == 2
    folder = RunFolder(run, resume=True)
    folder.prepare()
    folder.release()


def test_only_our_own_temporaries_are_removed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    mine = run / ".checkpoint.pt.a1b2.course_lib-partial"
    mine.write_bytes(b"left by a killed run")
    users = [run / ".notes.tmp", run / ".checkpoint.pt.draft.tmp", run / ".metrics.json.tmp"]
    for path in users:
        path.write_text("the user's")
    with pytest.raises(RunRefused):   # refused: no run to resume there
        RunFolder(run, resume=True).prepare()
    folder = RunFolder(run)
    folder.prepare()
    folder.release()
    assert not mine.exists()
    assert all(path.read_text() == "the user's" for path in users)


def _interrupt_final_evaluation(monkeypatch, signum):
    """Deliver ``signum`` while the final evaluation (the one over every window) runs."""
    import course_lib.runs.presets as presets
    real = presets.evaluate

    def evaluate(*args, **kwargs):
        os.kill(os.getpid(), signum)
        return real(*args, **kwargs)
    monkeypatch.setattr(presets, "evaluate", evaluate)


@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_final_evaluation_is_finished_by_resume(tmp_path, corpus, monkeypatch, capsys,
                                                               signum, status):
    run = tmp_path / "run"
    _interrupt_final_evaluation(monkeypatch, signum)
    assert main(["train", *FAST, "--steps", "3", "--corpus", str(corpus), "--out", str(run)]) == status
    err = capsys.readouterr().err
    assert "stopped during the final evaluation" in err and f"--resume {run}" in err and "Traceback" not in err
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "stopped" and metrics["pending"] == "final evaluation"
    assert metrics["steps"] == 3 and metrics["val_tokens"] is None
    monkeypatch.undo()

    # --steps is the new total: one below the steps already trained is refused, and nothing is evaluated
    assert main(["train", "--resume", str(run), "--steps", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "has trained 3 steps already, got --steps 2" in err and "Traceback" not in err
    assert json.loads((run / "metrics.json").read_text()) == metrics
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "final evaluation did not finish; doing it now" in out
    finished = json.loads((run / "metrics.json").read_text())
    assert finished["status"] == "finished" and finished["steps"] == 3 and finished["val_tokens"] > 0
    assert finished["run_id"] == metrics["run_id"] and "pending" not in finished
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert "already finished at step 3" in capsys.readouterr().out


def test_ctrl_c_before_any_save_says_nothing_was_saved(tmp_path, corpus, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("course_lib.runs.presets.prepare_preset", interrupted)
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "3", "--corpus", str(corpus), "--out", str(run)]) == 130
    err = capsys.readouterr().err
    assert "no checkpoint was saved" in err and "intact" not in err and "--resume" not in err
    monkeypatch.undo()
    assert main(["train", *FAST, "--steps", "3", "--corpus", str(corpus), "--out", str(run)]) == 0
    # the run's checkpoint is a plain torch file: its state and stamp, read without course_lib
    import torch
    payload = torch.load(run / "checkpoint.pt", weights_only=True)
    stamp = json.loads((run / "metrics.json").read_text())
    assert payload["training"]["step"] == 3 and payload["extra"]["run_id"] == stamp["run_id"]
    assert "head.weight" in payload["state_dict"]
    monkeypatch.setattr("course_lib.runs.presets.prepare_preset", interrupted)
    assert main(["train", "--resume", str(run), "--steps", "6", "--quiet"]) == 130
    err = capsys.readouterr().err
    assert f"the checkpoint in {run} (step 3) is intact" in err and f"--resume {run}" in err


def test_resume_refuses_another_text_with_the_same_characters(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "2", "--corpus", str(corpus), "--out", str(run)]) == 0
    other = tmp_path / "other.txt"
    other.write_text("".join(reversed(TEXT.splitlines(keepends=True))))   # same characters, other text
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "4", "--corpus", str(other), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: corpus:") and str(corpus) in err and str(other) in err
    corpus.write_text(TEXT.replace("question", "questoin"))   # the run's own file, changed since
    assert main(["train", "--resume", str(run), "--steps", "4", "--quiet"]) == 2
    assert "a different text" in capsys.readouterr().err
    corpus.write_text(TEXT)
    assert main(["train", "--resume", str(run), "--steps", "4", "--quiet"]) == 0


def test_a_corpus_too_short_for_the_context_is_refused_before_the_first_step(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("abcdefghij" * 20)   # 200 characters: its validation part is shorter than a window
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "100", "--corpus", str(short), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "too short" in err and "max_tokens=32" in err and "Traceback" not in err
    assert not (run / "checkpoint.pt").exists() and not (run / "metrics.json").exists()
