"""Messages at the last edges: each ends in one line naming the cause, never a traceback from deep inside.

A full disk while training, a corpus name that is not one, a text too short to split, a Preset object the
run cannot save, a checkpoint edited by hand (its checksum recomputed), a device that does not exist, an
export folder that is a link or cannot be written, and generate() on models it cannot drive.
"""
from __future__ import annotations

import errno
import io
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from course_lib import checkpoints
from course_lib.checkpoints import CheckpointError, load_checkpoint, save_checkpoint
from course_lib.data import CharTokenizer, corpus_splits, random_batch
from course_lib.generate import generate
from course_lib.heads import AttentionOnly, InductionConfig
from course_lib.model import GPT, GPTConfig
from course_lib.modern_gpt import ModernGPT, ModernGPTConfig
from course_lib.runs import presets
from course_lib.runs.export import ExportRefused, export_run
from course_lib.runs.presets import PRESETS, Preset, run_preset
from course_lib.runs.run_folder import RunFolder, RunRefused
from course_lib.train import TrainConfig, resolve_device

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n") * 30


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


# ---------------------------------------------------------------- a full disk while training

def _failing_save(monkeypatch, after: int):
    real = RunFolder.save
    calls = []

    def save(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.checkpoint))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(RunFolder, "save", save)


def test_a_full_disk_before_any_checkpoint_is_one_line(tmp_path, corpus, monkeypatch):
    _failing_save(monkeypatch, after=0)
    with pytest.raises(RunRefused) as error:
        run_preset("tiny", tmp_path / "run", steps=2, corpus=str(corpus), device="cpu", progress=False)
    text = one_line(error)
    assert text.startswith("out: could not write the checkpoint of step") and os.strerror(errno.ENOSPC) in text
    assert "no checkpoint was written yet" in text


def test_a_full_disk_later_keeps_the_checkpoint_and_says_so(tmp_path, corpus, monkeypatch):
    run_preset("tiny", tmp_path / "run", steps=2, corpus=str(corpus), device="cpu", progress=False)
    _failing_save(monkeypatch, after=0)
    with pytest.raises(RunRefused) as error:
        run_preset(None, tmp_path / "run", steps=4, device="cpu", progress=False, resume=True)
    text = one_line(error)
    assert "the checkpoint of step 2" in text and "is intact" in text and "--resume" in text
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt").training["step"] == 2


def test_the_command_line_shows_a_full_disk_in_one_line(tmp_path, corpus, monkeypatch, capsys):
    from course_lib.__main__ import main
    _failing_save(monkeypatch, after=0)
    status = main(["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--steps", "2", "--corpus",
                   str(corpus), "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error: out: could not write"), err


# ---------------------------------------------------------------- corpora

@pytest.mark.parametrize("name", ["wikitext", "NAMES", "TinyShakespeare", "shakespeare"])
def test_an_unknown_corpus_lists_the_known_ones(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as error:
        corpus_splits(name, 32)
    text = one_line(error)
    assert text.startswith("corpus: expected one of ['names', 'tinyshakespeare']") and repr(name) in text
    if name.lower() in ("names", "tinyshakespeare"):
        assert f"did you mean {name.lower()!r}" in text
    with pytest.raises(RunRefused) as error:
        run_preset("tiny", tmp_path / "run", corpus=name, steps=1, device="cpu", progress=False)
    assert "'names', 'tinyshakespeare'" in one_line(error)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.parametrize("text", ["a", "ab", "abc" * 20])
def test_a_corpus_too_short_says_what_it_needs(text, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError) as error:
        corpus_splits(path, 32)
    message = one_line(error)
    assert ("needs at least 330 characters" in message) or ("too short" in message), message
    with pytest.raises(RunRefused) as error:
        run_preset("tiny", tmp_path / "run", corpus=str(path), steps=1, device="cpu", progress=False)
    assert "too short" in one_line(error)


# ---------------------------------------------------------------- presets

def _mine(**changes):
    fields = dict(name="mine", description="a test", corpus="tinyshakespeare",
                  model=dict(max_tokens=16, embed_dim=16, num_heads=2, num_layers=1), train=TrainConfig(steps=1))
    fields.update(changes)
    return Preset(**fields)


def test_run_preset_with_an_unregistered_preset_is_refused_before_training(tmp_path):
    with pytest.raises(RunRefused) as error:
        run_preset(_mine(), tmp_path / "run", steps=1, device="cpu", progress=False)
    assert one_line(error).startswith("preset: a run saves its preset by name") and "PRESETS['mine']" in str(error.value)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_a_registered_preset_object_runs_and_resumes_by_name(tmp_path, corpus, monkeypatch):
    mine = _mine(corpus=str(corpus))
    monkeypatch.setitem(PRESETS, "mine", mine)
    metrics = run_preset(mine, tmp_path / "run", steps=1, device="cpu", progress=False)
    assert metrics["preset"] == "mine"
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt").training["preset"] == "mine"


@pytest.mark.parametrize("changes, field", [
    (dict(name=3), "Preset.name"), (dict(corpus=None), "Preset.corpus"), (dict(train={"steps": 1}), "Preset.train"),
    (dict(model=[("max_tokens", 16)]), "Preset.model"), (dict(model=dict(max_tokens=16, layers=2)), "Preset.model"),
    (dict(description=None), "Preset.description"),
])
def test_a_preset_names_its_wrong_field_when_written(changes, field):
    with pytest.raises((TypeError, ValueError)) as error:
        _mine(**changes)
    assert one_line(error).startswith((f"{field}: expected", f"{field}: GPTConfig has no field"))


@pytest.mark.parametrize("name", [3, "tiny2", ("tiny",)])
def test_run_preset_names_a_bad_preset(name, tmp_path):
    with pytest.raises(RunRefused) as error:
        run_preset(name, tmp_path / "run", steps=1, device="cpu", progress=False)
    assert one_line(error).startswith("preset: expected one of")


# ---------------------------------------------------------------- a checkpoint edited by hand

def _edited(tmp_path, edit) -> Path:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1))
    path = save_checkpoint(tmp_path / "model.pt", model, CharTokenizer("abcde"))
    payload = torch.load(path, weights_only=True)
    edit(payload)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    checkpoints.write_atomically(path, checkpoints._with_checksum(buffer.getvalue()))   # a valid checksum again
    return path


EDITS = {
    "no state_dict": lambda p: p.pop("state_dict"),
    "no config": lambda p: p.pop("config"),
    "config a list": lambda p: p.__setitem__("config", [1, 2]),
    "config a wrong value": lambda p: p["config"].__setitem__("embed_dim", "eight"),
    "config an unknown field": lambda p: p["config"].__setitem__("layers", 3),
    "config missing vocab_size": lambda p: p["config"].pop("vocab_size"),
    "config missing embed_dim": lambda p: p["config"].pop("embed_dim"),   # its default no longer fits the weights
    "config that does not divide": lambda p: p["config"].__setitem__("num_heads", 3),
    "weight missing": lambda p: p["state_dict"].pop("token_embedding.weight"),
    "weight unexpected": lambda p: p["state_dict"].__setitem__("extra.weight", torch.zeros(2)),
    "weight reshaped": lambda p: p["state_dict"].__setitem__("token_embedding.weight", torch.zeros(3, 8)),
    "weight not a tensor": lambda p: p["state_dict"].__setitem__("token_embedding.weight", [0.0]),
    "weight of ints": lambda p: p["state_dict"].__setitem__(
        "token_embedding.weight", torch.zeros(5, 8, dtype=torch.long)),
    "tokenizer garbled": lambda p: p.__setitem__("tokenizer", {"kind": "nonsense"}),
    "tokenizer a string": lambda p: p.__setitem__("tokenizer", "abcde"),
    "extra a list": lambda p: p.__setitem__("extra", [1]),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_checkpoint_edited_by_hand_is_named_in_one_line(edit, tmp_path):
    path = _edited(tmp_path, EDITS[edit])
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    assert one_line(error).startswith(f"path: {path}")
    model = GPT(GPTConfig(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1))
    if edit.startswith(("weight", "no state", "tokenizer", "extra", "no config", "config a list")):
        with pytest.raises(CheckpointError) as error:
            load_checkpoint(path, model)
        assert one_line(error).startswith(f"path: {path}")


# ---------------------------------------------------------------- devices

@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu", "", 0, True])
def test_a_device_that_does_not_exist_is_named_with_the_valid_ones(device, tmp_path):
    model = GPT(GPTConfig(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1))
    path = save_checkpoint(tmp_path / "model.pt", model)
    for call in (lambda: load_checkpoint(path, device=device), lambda: resolve_device(device),
                 lambda: random_batch(torch.arange(20), 2, 4, device=device)):
        with pytest.raises((TypeError, ValueError)) as error:
            call()
        text = one_line(error)
        assert text.startswith("device: expected") and "'cpu'" in text and "'cuda" in text and "'mps'" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_where_there_is_none_is_one_line(tmp_path):
    model = GPT(GPTConfig(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1))
    path = save_checkpoint(tmp_path / "model.pt", model)
    with pytest.raises(ValueError) as error:
        load_checkpoint(path, device="cuda")
    assert "CUDA is not available" in one_line(error)


# ---------------------------------------------------------------- export folders

@pytest.fixture
def run_dir(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1))
    save_checkpoint(tmp_path / "run" / "checkpoint.pt", model, CharTokenizer("abcde"))
    return tmp_path / "run"


def test_export_to_a_link_to_a_folder_is_refused(run_dir, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ExportRefused) as error:
        export_run(run_dir, tmp_path / "link")
    assert one_line(error).startswith(f"OUT_DIR: {tmp_path / 'link'} is a symbolic link")
    assert (tmp_path / "link").is_symlink() and not any((tmp_path / "real").iterdir())


def test_export_to_a_dangling_link_is_refused(run_dir, tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ExportRefused) as error:
        export_run(run_dir, tmp_path / "dangling")
    assert "a link to nothing" in one_line(error)
    assert (tmp_path / "dangling").is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("length", [250, 300, 5000])
def test_export_to_a_name_too_long_is_refused(run_dir, tmp_path, length):
    with pytest.raises(ExportRefused) as error:
        export_run(run_dir, tmp_path / ("x" * length))
    assert one_line(error).startswith("OUT_DIR:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]   # nothing left behind


def test_export_under_a_file_or_where_nothing_may_be_written_is_refused(run_dir, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ExportRefused) as error:
        export_run(run_dir, tmp_path / "afile" / "hf")
    assert one_line(error).startswith("OUT_DIR: cannot write")

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path))
    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    with pytest.raises(ExportRefused) as error:
        export_run(run_dir, tmp_path / "hf")
    assert one_line(error).startswith("OUT_DIR: cannot write") and "Permission denied" in str(error.value)


def test_export_on_a_full_disk_is_refused_and_leaves_nothing(run_dir, tmp_path, monkeypatch):
    from course_lib.hf import pretrained

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(pretrained, "save_pretrained", full)
    with pytest.raises(ExportRefused) as error:
        export_run(run_dir, tmp_path / "hf")
    assert "No space left" in one_line(error)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


# ---------------------------------------------------------------- generate on models it cannot drive

def test_generate_on_a_model_without_max_tokens_is_one_line():
    model = AttentionOnly(InductionConfig(vocab_size=8, half=4, embed_dim=8, min_period=2))
    with pytest.raises(TypeError) as error:
        generate(model, torch.zeros(1, 2, dtype=torch.long), 3, use_cache=False)
    assert one_line(error).startswith("model: expected a model whose config.max_tokens")
    with pytest.raises(TypeError) as error:
        generate(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long), 3)
    assert "config.max_tokens" in one_line(error)


@pytest.mark.parametrize("bad", [8, -1, 1000])
def test_an_attention_only_model_names_ids_outside_its_vocabulary(bad):
    model = AttentionOnly(InductionConfig(vocab_size=8, half=4, embed_dim=8, min_period=2))
    with pytest.raises(ValueError) as error:
        model(torch.tensor([[0, bad]]))
    assert one_line(error).startswith("idx: expected token ids in 0..7")
    with pytest.raises(ValueError) as error:
        generate(model, torch.tensor([[0, bad]]), 2, use_cache=False)
    assert one_line(error).startswith("idx: expected token ids in 0..7")


@pytest.mark.parametrize("options", [dict(ngram_prior=3), dict(hashed_ngrams=3), dict(ngram_prior=2, prior_features=True)])
def test_a_cache_with_recent_tokens_reused_at_another_batch_size_is_one_line(options):
    torch.manual_seed(0)
    model = ModernGPT(ModernGPTConfig(vocab_size=6, max_tokens=16, embed_dim=8, num_heads=2, num_kv_heads=1,
                                      num_layers=1, **options)).eval()
    cache = model.new_cache()
    model(torch.zeros(2, 3, dtype=torch.long), cache)
    with pytest.raises(ValueError) as error:
        model(torch.zeros(3, 1, dtype=torch.long), cache)
    assert one_line(error).startswith("cache: holds the last tokens of a batch of 2 sequences, got a batch of 3")


def test_presets_module_still_has_its_resume_path():
    # the registered-name rule leaves resume (name None) alone
    assert presets._registered_name(None) is None and presets._registered_name("tiny") == "tiny"
    assert presets._registered_name(replace(PRESETS["tiny"])) == "tiny"
