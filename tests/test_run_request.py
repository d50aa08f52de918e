"""A run request is one value: declared once (RunRequest), checked once where it is made, and the same
value whether it comes from the command line or from run_preset."""
from __future__ import annotations

import dataclasses
from dataclasses import fields

import pytest
import torch

from course_lib.__main__ import main
from course_lib.runs import presets
from course_lib.runs.presets import PRESETS, RunRequest, run_preset
from course_lib.runs.run_folder import RunRefused


@pytest.fixture
def requests_made(monkeypatch):
    """The requests that reach run_request, which then trains nothing."""
    made: list[RunRequest] = []

    def record(request):
        made.append(request)
        return {}
    monkeypatch.setattr(presets, "run_request", record)
    return made


@pytest.mark.parametrize("changes, message", [
    (dict(preset="tiny2"), "preset: expected one of"),
    (dict(preset=None), "preset: expected a preset name (or --resume DIR), got none"),
    (dict(out=3), "out: expected a folder path, got 3"),
    (dict(out=""), "out: expected a folder path, got ''"),
    (dict(resume=True, overwrite=True), "overwrite: expected either --resume or --overwrite, got both"),
    (dict(seconds=0), "seconds: expected a finite number > 0, got 0"),
    (dict(seconds=float("inf")), "seconds: expected a finite number > 0, got inf"),
    (dict(steps=0), "steps: expected a positive int, got 0"),
    (dict(steps=True), "steps: expected a positive int, got True"),
    (dict(steps=2.5), "steps: expected a positive int, got 2.5"),
    (dict(batch_size=-1), "batch_size: expected a positive int, got -1"),
    (dict(seed=-1), "seed: expected an int >= 0, got -1"),
    (dict(compile="yes"), "compile: expected True or False, got 'yes'"),
    (dict(progress=1), "progress: expected True or False, got 1"),
    (dict(device="tpu"), "device: expected 'cpu', 'cuda', 'cuda:N' or 'mps', got 'tpu'"),
    (dict(corpus=3), "corpus: expected a corpus name or a file path, got 3"),
])
def test_a_request_names_its_wrong_field_when_made_and_touches_nothing(tmp_path, changes, message):
    asked = dict(preset="tiny", out=tmp_path / "run", steps=1, device="cpu", progress=False)
    asked.update(changes)
    with pytest.raises(RunRefused) as error:
        RunRequest(asked.pop("preset"), asked.pop("out"), **asked)
    assert str(error.value).startswith(message)
    # the same refusal through run_preset, and nothing on disk: the folder is not even made
    asked_again = dict(dict(preset="tiny", out=tmp_path / "run", steps=1, device="cpu", progress=False), **changes)
    with pytest.raises(RunRefused) as again:
        run_preset(asked_again.pop("preset"), asked_again.pop("out"), **asked_again)
    assert str(again.value) == str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_a_checked_request_holds_plain_answers_and_cannot_change(tmp_path, monkeypatch):
    mine = dataclasses.replace(PRESETS["tiny"], name="mine")
    monkeypatch.setitem(PRESETS, "mine", mine)
    request = RunRequest(mine, str(tmp_path / "run"))
    assert request.preset == "mine"                          # a registered Preset is kept as its name
    assert isinstance(request.device, torch.device)          # None: the fastest here, chosen once
    assert RunRequest(None, tmp_path, resume=1).resume is True   # truth values, as run_preset always took them
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.steps = 5


def test_run_preset_and_the_command_line_make_the_same_request(tmp_path, requests_made):
    out = str(tmp_path / "run")
    run_preset("tiny", out, steps=3, corpus="names", device="cpu", progress=False, compile=True, batch_size=4)
    assert main(["train", "--preset", "tiny", "--out", out, "--steps", "3", "--corpus", "names", "--device", "cpu",
                 "--quiet", "--compile", "--batch-size", "4"]) == 0
    assert main(["train", "--resume", out, "--seconds", "2.5"]) == 0
    assert main(["train", "--preset", "shakespeare_char_gpu", "--out", out, "--no-compile", "--device", "cpu"]) == 0
    assert main(["train", "--preset", "shakespeare_char_gpu", "--out", out, "--device", "cpu"]) == 0
    by_hand, by_cli, resumed, not_compiled, as_preset = requests_made
    assert by_hand == by_cli
    assert resumed == RunRequest(None, out, seconds=2.5, resume=True)
    # --no-compile turns off a preset's compile; without either flag the preset decides
    assert (not_compiled.compile, as_preset.compile) == (False, None)
    assert list(tmp_path.iterdir()) == []   # a request is only asked for: nothing was touched


def test_the_command_line_refuses_a_bad_request_in_one_line(tmp_path, capsys, requests_made):
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: steps: expected a positive int, got 0") and err.count("\n") == 1
    assert "Traceback" not in err and requests_made == []


def test_run_preset_takes_exactly_the_request_fields(tmp_path):
    with pytest.raises(TypeError, match="stepz"):
        run_preset("tiny", tmp_path / "run", stepz=3)
    with pytest.raises(TypeError):
        run_preset("tiny", tmp_path / "run", 3)   # the options are keywords only, as before
    assert [f.name for f in fields(RunRequest)][:2] == ["preset", "out"]
    with pytest.raises(TypeError, match=r"request: expected a RunRequest, got .*dict"):
        presets.run_request({"preset": "tiny"})
