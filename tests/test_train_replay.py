"""Train once, replay after (course_lib.train_replay): the learner-copy test pass reuses what the
solution pass trained, and only when every input of the training is the same. The lesson's code knows
nothing of it: tests/train_replay_hook wraps the training entry points in the notebook tests' kernels."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_lib import GPT, GPTConfig, heads, train_replay
from course_lib import train as train_module
from course_lib.classroom import capstone
from course_lib.classroom.capstone import TrainingSetup
from course_lib.classroom.collect import collect_student_parts
from course_lib.data import CharTokenizer, TokenStream
from course_lib.train import History, TrainConfig
from course_lib.train_replay import RECORD_ENV, REPLAY_ENV

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "tests" / "train_replay_hook"
# What the hook makes of course_lib.train.train in the notebook tests' kernels.
train = train_replay.replayable(History.from_dict)(train_module.train)

TEXT = "the cat sat on the mat. the dog sat on the log. " * 40
CONFIG = TrainConfig(steps=12, batch_size=4, learning_rate=3e-3, warmup_steps=2, eval_interval=6, eval_windows=8)


def _setup(seed=0, text=TEXT):
    tok = CharTokenizer.from_text(TEXT)
    ids = torch.tensor(tok.encode(text))
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, max_tokens=16, embed_dim=32, num_heads=2, num_layers=2,
                          dropout_rate=0.1))
    return model, TokenStream(ids[:1600]), TokenStream(ids[1600:])


def _run(seed=0, text=TEXT, config=CONFIG):
    model, train_split, val_split = _setup(seed, text)
    history = train(model, train_split, val_split, config, device="cpu", progress=False)
    return model, history, torch.get_rng_state()


def test_replay_gives_the_recorded_weights_history_and_random_state(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    trained, history, rng_after = _run()
    assert len(list(tmp_path.glob("*.pt"))) == 1
    monkeypatch.delenv(RECORD_ENV)
    monkeypatch.setenv(REPLAY_ENV, str(tmp_path))
    capsys.readouterr()
    replayed, replayed_history, replayed_rng = _run()
    assert "replayed" in capsys.readouterr().out
    for (name, a), b in zip(trained.state_dict().items(), replayed.state_dict().values()):
        assert torch.equal(a, b), name
    assert replayed_history == history
    assert torch.equal(replayed_rng, rng_after)   # the kernel's random state moves on as training moved it
    assert replayed.training == trained.training


@pytest.mark.parametrize("change", ["seed", "data", "config", "course code"])
def test_any_different_input_trains_instead(tmp_path, monkeypatch, capsys, change):
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    _run()
    monkeypatch.delenv(RECORD_ENV)
    monkeypatch.setenv(REPLAY_ENV, str(tmp_path))
    capsys.readouterr()
    if change == "course code":   # a record made before the course's code changed (the loop, a model)
        monkeypatch.setattr(train_replay, "_course_code", lambda: "an edited course_lib")
    kwargs = {"seed": dict(seed=1), "data": dict(text=TEXT.replace("cat", "act")),
              "config": dict(config=TrainConfig(**{**CONFIG.__dict__, "learning_rate": 1e-3})),
              "course code": {}}[change]
    model, history, _ = _run(**kwargs)
    assert "replayed" not in capsys.readouterr().out
    assert history.steps_taken == CONFIG.steps


def test_nothing_is_recorded_or_replayed_without_the_variables(tmp_path, monkeypatch):
    monkeypatch.delenv(RECORD_ENV, raising=False)
    monkeypatch.delenv(REPLAY_ENV, raising=False)
    monkeypatch.chdir(tmp_path)

    def no_key(*args, **kwargs):
        raise AssertionError("a training outside the Makefile's tests must not be keyed, recorded or replayed")

    monkeypatch.setattr(train_replay, "run_key", no_key)
    _, history, _ = _run()
    assert history.steps_taken == CONFIG.steps
    assert list(tmp_path.iterdir()) == []


def test_a_wrong_call_names_train_as_the_student_wrote_it():
    model, train_split, _ = _setup()
    with pytest.raises(TypeError, match=r"^train\(\)"):
        train(model, train_split)                              # val_split and config missing
    with pytest.raises(TypeError, match=r"config: expected a TrainConfig"):
        train(model, train_split, None, {"steps": 3})


# ------------------------------------------------------------------ the hook

def test_the_lesson_code_knows_nothing_of_replay():
    for module in (train_module, heads, capstone):
        assert "train_replay" not in Path(module.__file__).read_text(), module.__name__


def test_the_hook_wraps_every_entry_point_as_a_notebook_imports_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != RECORD_ENV}
    env.update(PYTHONPATH=os.pathsep.join([str(HOOK), env.get("PYTHONPATH", "")]), COURSE_TRAIN_REPLAY=str(tmp_path))
    code = ("from course_lib.train import train\n"                   # as notebooks 05 and 09 import it
            "from course_lib import heads\n"
            "from course_lib.classroom import capstone\n"
            "print([f.__code__.co_filename.endswith('train_replay.py') for f in "
            "(train, heads.train_induction, capstone.train_parts)])\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[True, True, True]"


@pytest.mark.parametrize("variable", [None, RECORD_ENV, REPLAY_ENV])
def test_the_hook_hooks_only_under_a_variable(monkeypatch, variable):
    import importlib.util
    monkeypatch.delenv(RECORD_ENV, raising=False)
    monkeypatch.delenv(REPLAY_ENV, raising=False)
    if variable:
        monkeypatch.setenv(variable, "/nowhere")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = list(sys.meta_path)
    spec = importlib.util.spec_from_file_location("_hook_under_test", HOOK / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    added = [type(f).__name__ for f in sys.meta_path if f not in before]
    assert added == (["_WrapAfterExec"] if variable else [])


INDUCTION = heads.InductionConfig(steps=20, log_every=10, embed_dim=16, vocab_size=16, half=8)


def test_train_induction_replays_its_weights_and_curves_and_leaves_the_random_state_alone(tmp_path, monkeypatch,
                                                                                            capsys):
    induction = train_replay.replayable_induction(heads.train_induction, heads)
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    trained = induction(INDUCTION)
    assert len(list(tmp_path.glob("*.pt"))) == 1
    monkeypatch.delenv(RECORD_ENV)
    monkeypatch.setenv(REPLAY_ENV, str(tmp_path))
    capsys.readouterr()
    before = torch.get_rng_state()
    replayed = induction(INDUCTION)
    assert "replayed" in capsys.readouterr().out
    assert torch.equal(torch.get_rng_state(), before)
    assert isinstance(replayed, heads.InductionRun) and replayed.config == INDUCTION
    assert (replayed.steps, replayed.first_half, replayed.second_half) == (
        trained.steps, trained.first_half, trained.second_half)
    for (name, a), b in zip(trained.model.state_dict().items(), replayed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert not replayed.model.training
    other = induction(heads.InductionConfig(**{**INDUCTION.__dict__, "seed": 1}))   # another input: it trains
    assert "replayed" not in capsys.readouterr().out and other.steps == trained.steps
    assert other.second_half != trained.second_half


def _tiny_setup(steps: int = 12) -> TrainingSetup:
    ids = torch.arange(2000) % 7                                                   # 0 1 2 ... 6 0 1 ...
    config = GPTConfig(vocab_size=7, embed_dim=16, num_heads=2, num_layers=1, max_tokens=8, dropout_rate=0.1)

    def batches(generator):
        starts = torch.randint(len(ids) - 9, (8,), generator=generator)            # (8,)
        windows = torch.stack([ids[s:s + 9] for s in starts.tolist()])             # (8, 9)
        return windows[:, :-1], windows[:, 1:]

    val = torch.stack([ids[s:s + 9] for s in range(0, 200, 9)])
    return TrainingSetup("tiny", config, batches, val[:, :-1], val[:, 1:], steps, eval_every=6)


def test_train_parts_replays_a_run_with_the_same_code_and_trains_one_with_other_code(tmp_path, monkeypatch,
                                                                                     capsys):
    parts = train_replay.replayable_parts(capstone.train_parts)
    solutions = collect_student_parts(ROOT / "notebooks")
    setup = _tiny_setup()
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    torch.manual_seed(5)
    reference = parts(solutions, [], setup, label="reference")
    rng_after = torch.get_rng_state()
    # Later in the recording pass, the same training is the record's, silently (strict nbval compares
    # the cell's output): nothing more is recorded.
    capsys.readouterr()
    again = parts(solutions, [], setup, label="again")
    assert "replayed" not in capsys.readouterr().out and len(list(tmp_path.glob("*.pt"))) == 1
    assert again.val_loss == reference.val_loss and again.label == "again"
    monkeypatch.delenv(RECORD_ENV)
    monkeypatch.setenv(REPLAY_ENV, str(tmp_path))
    capsys.readouterr()
    # The solutions' own parts are the same code as the course's: the same key, so a replay.
    torch.manual_seed(6)
    yours = parts(solutions, None, setup)
    assert "replayed" in capsys.readouterr().out
    assert yours.label == "yours" and reference.label == "reference"
    assert (yours.step, yours.train_loss, yours.val_step, yours.val_loss) == (
        reference.step, reference.train_loss, reference.val_step, reference.val_loss)
    assert torch.equal(torch.get_rng_state(), rng_after)
    for (name, a), b in zip(reference.model.state_dict().items(), yours.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert yours.model.training == reference.model.training and "train_step" in yours.namespace
    # Other code in one part, another schedule, other data: each trains.
    no_scale = solutions.with_part("3.3", solutions.parts["3.3"].exercise.solution.replace(
        " / self.head_dim ** 0.5", ""))
    assert no_scale.parts["3.3"].source != solutions.parts["3.3"].exercise.solution
    other_data = TrainingSetup(**{**setup.__dict__, "val_inputs": setup.val_inputs.flip(0)})
    for args, kwargs in [((no_scale, None, setup), {}), ((solutions, [], setup), {"steps": 6}),
                         ((solutions, [], other_data), {})]:
        run = parts(*args, **kwargs)
        assert "replayed" not in capsys.readouterr().out
        assert len(run.step) == kwargs.get("steps", setup.steps)
