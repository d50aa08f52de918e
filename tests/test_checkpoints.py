"""Checkpoints: verified on load, refused at save time when they could not be loaded back, atomic."""
import io
import os

import pytest
import torch

from course_lib import GPT, GPTConfig
from course_lib.checkpoints import (
    CHECKSUM_PREFIX,
    CheckpointError,
    load_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
    write_atomically,
)
from course_lib.data import CharTokenizer
from course_lib.runs.run_folder import RunFolder, RunRefused
from course_lib.train import History


def tiny_model(vocab_size=7):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, max_tokens=8, embed_dim=16, num_heads=2, num_layers=1))


@pytest.fixture
def saved(tmp_path):
    return save_checkpoint(tmp_path / "ck.pt", tiny_model(), CharTokenizer("abcdefg"), extra={"step": 3},
                           training={"step": 3, "rng": torch.arange(4, dtype=torch.uint8)})


def test_round_trip_keeps_weights_tokenizer_extra_and_training_state(saved):
    loaded = load_checkpoint(saved)
    for name, value in tiny_model().state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value)
    assert loaded.tokenizer == CharTokenizer("abcdefg")
    assert loaded.extra == {"step": 3}
    assert loaded.training["step"] == 3 and torch.equal(loaded.training["rng"], torch.arange(4, dtype=torch.uint8))


def test_plain_torch_load_with_weights_only_opens_a_checkpoint(saved):
    payload = torch.load(saved, weights_only=True)
    model = tiny_model()
    assert payload["state_dict"].keys() == model.state_dict().keys()
    assert all(torch.equal(payload["state_dict"][k], v) for k, v in model.state_dict().items())
    assert payload["config"] == model.config.to_dict() and payload["extra"] == {"step": 3}
    assert payload["tokenizer"]["kind"] == "char" and payload["training"]["step"] == 3
    fresh = GPT(GPTConfig(**payload["config"]))
    fresh.load_state_dict(payload["state_dict"])   # what a PyTorch user does with no course_lib at hand


def test_the_checksum_travels_inside_the_file(saved, tmp_path):
    """Copying the checkpoint alone keeps it verifiable: no sidecar file, the hash ends the file itself."""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]
    copy = tmp_path / "elsewhere" / "copy.pt"
    copy.parent.mkdir()
    copy.write_bytes(saved.read_bytes())
    assert CHECKSUM_PREFIX in copy.read_bytes()[-100:]
    assert torch.equal(load_checkpoint(copy).model.state_dict()["head.weight"], tiny_model().head.weight)


def test_a_flipped_byte_anywhere_is_refused_naming_the_file(saved):
    original = saved.read_bytes()
    # torch's zip records and the tensor data (about 40 positions across the file), then every byte of
    # the end-of-archive record and of the checksum comment
    positions = sorted({0, 5, *range(70, len(original), len(original) // 37), *range(len(original) - 110,
                                                                                     len(original))})
    for position in positions:
        damaged = bytearray(original)
        damaged[position] ^= 0x01
        saved.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointError, match=r"ck\.pt is (damaged|not a course checkpoint)") as info:
            load_checkpoint(saved)
        assert "weights_only" not in str(info.value), position
    saved.write_bytes(original[:-100])   # truncated, as by a full disk
    with pytest.raises(CheckpointError, match="damaged"):
        load_checkpoint(saved)
    saved.write_bytes(original + b"\n")   # something appended
    with pytest.raises(CheckpointError, match="damaged"):
        load_checkpoint(saved)


def test_a_plain_torch_save_without_the_checksum_is_refused(tmp_path):
    model = tiny_model()
    torch.save({"format_version": 3, "architecture": "gpt", "config": model.config.to_dict(),
                "state_dict": model.state_dict(), "tokenizer": None, "extra": {}, "training": None},
               tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match=r"plain\.pt is damaged or was not written by save_checkpoint"):
        load_checkpoint(tmp_path / "plain.pt")


def test_a_checkpoint_of_an_earlier_course_lib_is_refused_saying_so(saved, tmp_path):
    old = tmp_path / "old.pt"   # the earlier format: a text header, then the torch.save bytes
    old.write_bytes(b"COURSE-CHECKPOINT v2 sha256=" + b"0" * 64 + b"\n" + saved.read_bytes())
    with pytest.raises(CheckpointError, match=r"old\.pt was written by an earlier course_lib.*train the run again"):
        load_checkpoint(old)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_malicious_pickle_is_refused_without_suggesting_weights_only_false(tmp_path):
    from course_lib.checkpoints import _with_checksum
    buffer = io.BytesIO()
    torch.save({"format_version": 3, "payload": _Evil()}, buffer)
    path = tmp_path / "evil.pt"
    # a valid checksum: the file is intact, its contents are what is refused
    path.write_bytes(_with_checksum(buffer.getvalue()))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "evil.pt" in message and "weights_only" not in message and "\x1b[" not in message
    torch.save({"payload": _Evil()}, tmp_path / "unchecked.pt")   # no checksum at all: refused too
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "unchecked.pt")
    assert "weights_only" not in str(info.value)


def test_save_refuses_what_load_could_not_read_back(tmp_path):
    with pytest.raises(TypeError, match=r"extra\['history'\]: expected plain data .* got History; "
                                        r"convert it with \.to_dict\(\)"):
        save_checkpoint(tmp_path / "ck.pt", tiny_model(), extra={"history": History()})
    with pytest.raises(TypeError, match=r"training\['x'\]\[1\]: expected plain data .* got object"):
        save_checkpoint(tmp_path / "ck.pt", tiny_model(), training={"x": [1, object()]})
    assert not any(tmp_path.iterdir())   # refused before anything was written
    path = save_checkpoint(tmp_path / "ck.pt", tiny_model(), extra={"history": History().to_dict()})
    assert load_checkpoint(path).extra["history"]["steps_taken"] == 0


def test_interrupted_writes_leave_no_temporary_file_and_stale_ones_are_removed(tmp_path, monkeypatch):
    target = tmp_path / "ck.pt"
    target.write_bytes(b"old")

    def fail(*args):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]
    (tmp_path / ".checkpoint.pt.abc123.course_lib-partial").write_bytes(b"half")   # what a SIGKILL leaves
    (tmp_path / ".metrics.json.x.course_lib-partial").write_bytes(b"half")
    (tmp_path / ".notes.tmp").write_bytes(b"the user's")   # not ours: never removed
    assert len(remove_stale_temporaries(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.tmp", "ck.pt"]


def test_run_folder_refuses_files_and_existing_runs_and_clears_what_it_replaces(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunRefused, match="out: expected a folder .* got the existing file"):
        RunFolder(tmp_path / "file").prepare()
    with pytest.raises(RunRefused, match="out: expected a folder this process can write"):
        RunFolder(tmp_path / "file" / "sub").prepare()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text('{"preset": "tiny", "steps": 40}')
    (run / "checkpoint.pt").write_bytes(b"x")
    (run / ".checkpoint.pt.1.course_lib-partial").write_bytes(b"half")
    (run / ".draft.tmp").write_bytes(b"the user's")
    with pytest.raises(RunRefused, match=r"already holds a run \(preset 'tiny', step 40.*--resume .*--overwrite"):
        RunFolder(run).prepare()
    replacing = RunFolder(run, overwrite=True)
    replacing.prepare()
    assert sorted(p.name for p in run.iterdir()) == [".course_lib-run.lock", ".draft.tmp", "checkpoint.pt",
                                                     "metrics.json"]   # our stale temporary gone, theirs kept
    replacing.clear_replaced_run()   # once every check has passed
    assert sorted(p.name for p in run.iterdir()) == [".course_lib-run.lock", ".draft.tmp"]
    replacing.release()
    with pytest.raises(RunRefused, match="resume: expected a run folder holding checkpoint.pt"):
        RunFolder(run, resume=True).prepare()


def test_numpy_scalars_and_other_near_plain_values_are_saved_as_what_load_accepts(tmp_path):
    import collections
    import enum

    import numpy as np

    class Colour(enum.IntEnum):
        RED = 1
    model = GPT(GPTConfig(vocab_size=5, max_tokens=4, embed_dim=8, num_heads=2, num_layers=1))
    extra = {"v": np.float64(1.5), "n": np.int64(3), "c": Colour.RED,
             "o": collections.OrderedDict(a=np.float32(2.0)), "d": collections.defaultdict(int, b=2)}
    save_checkpoint(tmp_path / "ck.pt", model, extra=extra)
    loaded = load_checkpoint(tmp_path / "ck.pt").extra
    assert loaded == {"v": 1.5, "n": 3, "c": 1, "o": {"a": 2.0}, "d": {"b": 2}}
    assert type(loaded["v"]) is float and type(loaded["n"]) is int
    with pytest.raises(TypeError, match=r"extra\['a'\]\['b'\]: expected plain data .* got ndarray; convert it with torch.as_tensor"):
        save_checkpoint(tmp_path / "bad.pt", model, extra={"a": {"b": np.zeros(3)}})
    assert not (tmp_path / "bad.pt").exists()


def test_load_checkpoint_leaves_the_callers_random_numbers_alone(tmp_path):
    model = GPT(GPTConfig(vocab_size=5, max_tokens=4, embed_dim=8, num_heads=2, num_layers=1))
    save_checkpoint(tmp_path / "ck.pt", model)
    torch.manual_seed(0)
    load_checkpoint(tmp_path / "ck.pt")
    after_load = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after_load, torch.rand(3))


def test_a_modern_gpt_checkpoint_holds_only_plain_values(tmp_path):
    from course_lib.modern_gpt import ModernGPT, ModernGPTConfig
    torch.manual_seed(0)
    model = ModernGPT(ModernGPTConfig(vocab_size=7, max_tokens=8, embed_dim=16, num_heads=2, num_layers=1))
    path = save_checkpoint(tmp_path / "modern.pt", model, CharTokenizer("abcdefg"))
    payload = torch.load(path, weights_only=True)

    def plain(value):
        if isinstance(value, dict):
            return all(isinstance(k, (str, int)) and plain(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (bool, int, float, str, torch.Tensor))
    assert payload["architecture"] == "modern" and plain(payload)
    assert ModernGPTConfig.from_dict(payload["config"]) == model.config
    assert type(load_checkpoint(path).model) is ModernGPT
