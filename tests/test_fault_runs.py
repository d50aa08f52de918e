"""What a scripted fault run found (2026-11-29): a run folder whose checkpoint.pt or metrics.json is a link or a
folder, a save that fails between its two files, a checkpoint no run wrote, and COURSE_THREADS that is no number.
Each ends in one line that names the cause, before any training or with the step that is really kept."""
from __future__ import annotations

import errno
import os

import pytest

from course_lib.checkpoints import load_checkpoint, save_checkpoint
from course_lib.data import CharTokenizer
from course_lib.model import GPT, GPTConfig
from course_lib.runs import run_folder
from course_lib.runs.presets import run_preset
from course_lib.runs.run_folder import RunRefused

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n") * 30


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.mark.parametrize("kind", ["link to a file", "dangling link", "folder"])
@pytest.mark.parametrize("name", ["checkpoint.pt", "metrics.json"])
def test_a_run_file_that_is_no_file_is_refused_before_training(tmp_path, corpus, kind, name, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    target = out / name
    if kind == "folder":
        target.mkdir()
    else:
        elsewhere = tmp_path / "elsewhere"
        if kind == "link to a file":
            elsewhere.write_bytes(b"keep me")
        target.symlink_to(elsewhere)
    trained = []
    monkeypatch.setattr("course_lib.runs.presets.training.train", lambda *a, **k: trained.append(1))
    with pytest.raises(RunRefused) as error:
        run_preset("tiny", out, steps=2, corpus=str(corpus), device="cpu", progress=False, overwrite=True)
    text = str(error.value)
    assert "\n" not in text and text.startswith(f"out: {name} in ") and "replace" in text, text
    assert not trained
    if kind == "link to a file":
        assert (tmp_path / "elsewhere").read_bytes() == b"keep me"


def test_a_save_that_fails_after_the_checkpoint_names_the_step_the_checkpoint_holds(tmp_path, corpus, monkeypatch):
    real = run_folder.write_atomically
    calls = []

    def full_after_the_first(path, data):
        if os.path.basename(path) == "metrics.json":
            calls.append(1)
            if len(calls) > 1:   # the first metrics.json went; the next save's does not
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data)
    monkeypatch.setattr(run_folder, "write_atomically", full_after_the_first)
    with pytest.raises(RunRefused) as error:
        run_preset("tiny", tmp_path / "run", steps=100, corpus=str(corpus), device="cpu", progress=False)
    text = str(error.value)
    saved = load_checkpoint(tmp_path / "run" / "checkpoint.pt").training["step"]
    assert f"metrics.json of step {saved}" in text and f"the checkpoint of step {saved}" in text, (saved, text)
    assert "--resume" in text


def test_a_checkpoint_no_run_wrote_is_refused_in_one_line(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    model = GPT(GPTConfig(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1))
    save_checkpoint(out / "checkpoint.pt", model, CharTokenizer("abcde"), training={"step": 3})
    with pytest.raises(RunRefused) as error:
        run_preset(None, out, steps=5, device="cpu", progress=False, resume=True)
    assert "no run of `train` wrote" in str(error.value) and "'train_config'" in str(error.value)


def test_course_threads_that_is_no_number_is_named(monkeypatch):
    from course_lib.runtime import course_threads
    monkeypatch.setenv("COURSE_THREADS", "abc")
    with pytest.raises(ValueError, match="COURSE_THREADS: expected a whole number"):
        course_threads()
    monkeypatch.setenv("COURSE_THREADS", "0")
    assert course_threads() == 1
    monkeypatch.delenv("COURSE_THREADS")
    assert course_threads() is None


def test_a_full_disk_while_writing_the_learner_copies_is_one_line_naming_the_folder(tmp_path, monkeypatch, capsys):
    from course_lib.classroom import assignments
    src = tmp_path / "src"
    src.mkdir()
    (src / "01_attention_toy.ipynb").write_text("{}")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "out" / "01_attention_toy.ipynb"))
    monkeypatch.setattr(assignments, "update_learner_copies", full)
    assert assignments._write_and_report(src, tmp_path / "out") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: out_dir: could not read or write ") and "make room" in err[0]


def test_a_lock_file_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    from course_lib.runs.run_folder import RunFolder

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(run_folder.os, "pwrite", full)
    with pytest.raises(RunRefused, match=r"^out: cannot write the lock file .*No space left on device.*make room"):
        RunFolder(tmp_path / "run").prepare()
