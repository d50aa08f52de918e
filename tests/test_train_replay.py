"""Train once, replay after (course_lib.train_replay): the learner-copy test pass reuses what the
solution pass trained, and only when every input of the training is the same."""
import pytest
import torch

from course_lib import GPT, GPTConfig, train_replay
from course_lib.data import CharTokenizer, TokenStream
from course_lib.train import TrainConfig, train
from course_lib.train_replay import RECORD_ENV, REPLAY_ENV

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


@pytest.mark.parametrize("change", ["seed", "data", "config"])
def test_any_different_input_trains_instead(tmp_path, monkeypatch, capsys, change):
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    _run()
    monkeypatch.delenv(RECORD_ENV)
    monkeypatch.setenv(REPLAY_ENV, str(tmp_path))
    capsys.readouterr()
    kwargs = {"seed": dict(seed=1), "data": dict(text=TEXT.replace("cat", "act")),
              "config": dict(config=TrainConfig(**{**CONFIG.__dict__, "learning_rate": 1e-3}))}[change]
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
