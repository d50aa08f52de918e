"""Muon for the blocks' matrices beside AdamW; ModernGPT through the loop, checkpoints and --resume."""
import math

import pytest
import torch

from course_lib import GPT, GPTConfig
from course_lib.checkpoints import CheckpointError, load_checkpoint, save_checkpoint
from course_lib.data import CharTokenizer, TokenStream
from course_lib.modern_gpt import ModernGPT, ModernGPTConfig
from course_lib.optimizers import MuonWithAdamW, build_optimizer, hidden_matrices
from course_lib.train import TrainConfig, TrainState, train

TEXT = "the cat sat on the mat. the dog sat on the log. " * 40


def _splits():
    tok = CharTokenizer.from_text(TEXT)
    ids = torch.tensor(tok.encode(TEXT))
    cut = int(0.9 * len(ids))
    return tok, TokenStream(ids[:cut]), TokenStream(ids[cut:])


def _modern(vocab_size, **overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=vocab_size, max_tokens=16, embed_dim=32, num_heads=4, num_kv_heads=2, num_layers=2,
                  mlp="relu2", tie_weights=True)
    return ModernGPT(ModernGPTConfig(**{**config, **overrides}))


def _gpt(vocab_size):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, max_tokens=16, embed_dim=32, num_heads=2, num_layers=2))


MUON = dict(optimizer="muon", learning_rate=3e-3, muon_learning_rate=0.02, warmup_steps=3)


@pytest.mark.parametrize("build", [_gpt, _modern])
def test_muon_takes_exactly_the_blocks_matrices_and_adamw_everything_else(build):
    model = build(20)
    optimizer = build_optimizer(model, TrainConfig(**MUON), "cpu")
    assert isinstance(optimizer, MuonWithAdamW)
    muon = [p for g in optimizer.muon.param_groups for p in g["params"]]
    adamw = [p for g in optimizer.adamw.param_groups for p in g["params"]]
    expected = {id(p) for name, p in model.named_parameters() if name.startswith("blocks.") and p.dim() == 2}
    assert {id(p) for p in muon} == expected and len(muon) == len(expected)
    # every parameter in exactly one of the two, the tied head/embedding once
    everything = [id(p) for p in model.parameters()]
    assert sorted(id(p) for p in muon + adamw) == sorted(everything)
    embedding = model.token_embedding.weight
    assert any(p is embedding for p in adamw)
    assert [g["lr_scale"] for g in optimizer.muon.param_groups] == [pytest.approx(0.02 / 3e-3)]
    assert all(g["lr_scale"] == 1.0 for g in optimizer.adamw.param_groups)


def test_the_loop_sets_each_group_its_own_learning_rate():
    tok, train_split, _ = _splits()
    model = _modern(tok.vocab_size)
    config = TrainConfig(steps=6, batch_size=4, eval_interval=100, log_interval=1, min_learning_rate=3e-3, **MUON)
    history = train(model, train_split, None, config, device="cpu", progress=False)
    assert history.learning_rate[-1] == pytest.approx(3e-3)   # past the warmup, min = max: constant


def test_muon_lowers_the_loss_of_a_modern_gpt():
    tok, train_split, val_split = _splits()
    config = TrainConfig(steps=60, batch_size=8, eval_interval=30, eval_windows=8, log_interval=5, **MUON)
    history = train(_modern(tok.vocab_size), train_split, val_split, config, device="cpu", progress=False)
    # from ln(vocab) (uniform guessing) at the start to well under half of it
    assert history.val_loss[-1] < 0.5 * math.log(tok.vocab_size)


def test_muon_and_a_modern_gpt_resume_exactly_from_a_checkpoint(tmp_path):
    tok, train_split, val_split = _splits()
    config = TrainConfig(steps=24, batch_size=4, eval_interval=6, eval_windows=8, log_interval=3, **MUON)
    whole = train(_modern(tok.vocab_size), train_split, val_split, config, device="cpu", progress=False)

    model, saved, asked = _modern(tok.vocab_size), [], []
    train(model, train_split, val_split, config, device="cpu", progress=False,
          on_checkpoint=lambda state: saved.append(save_checkpoint(
              tmp_path / f"ck{state.step}.pt", model, tok, training=state.to_dict())),
          should_stop=lambda: asked.append(1) or len(asked) > 11)
    last = load_checkpoint(saved[-1])
    assert isinstance(last.model, ModernGPT) and last.training["step"] == 11
    resumed = train(last.model, train_split, val_split, config, device="cpu", progress=False,
                    state=TrainState.from_dict(last.training))
    # Muon's momentum and AdamW's moments both come back: a lost one moves the loss by far more
    gap = max(abs(a - b) for a, b in zip(resumed.train_loss + resumed.val_loss, whole.train_loss + whole.val_loss))
    assert gap <= 1e-6, gap


def test_a_modern_checkpoint_names_its_architecture_and_refuses_the_wrong_model(tmp_path):
    tok, _, _ = _splits()
    model = _modern(tok.vocab_size, qk_norm=True).eval()
    path = save_checkpoint(tmp_path / "m.pt", model, tok)
    loaded = load_checkpoint(path)
    assert isinstance(loaded.model, ModernGPT) and loaded.model.config == model.config
    idx = torch.tensor([tok.encode("the cat")])
    assert torch.equal(loaded.model.eval()(idx), model(idx))
    with pytest.raises(TypeError, match="model: the checkpoint holds a ModernGPT, got a GPT"):
        load_checkpoint(path, model=_gpt(tok.vocab_size))


def test_an_adamw_state_is_refused_by_muon_with_a_message():
    model = _modern(20)
    muon = build_optimizer(model, TrainConfig(**MUON), "cpu")
    adamw = build_optimizer(model, TrainConfig(), "cpu")
    with pytest.raises(ValueError, match="state: expected the state of a Muon"):
        muon.load_state_dict(adamw.state_dict())


@pytest.mark.parametrize("field, value, match", [
    ("optimizer", "sgd", "optimizer: expected one of"),
    ("muon_learning_rate", 0.0, "muon_learning_rate"),
    ("muon_momentum", 1.0, "muon_momentum: expected a number in"),
])
def test_train_config_names_a_bad_optimizer_setting(field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{field: value})


def test_hidden_matrices_refuses_a_model_without_blocks():
    with pytest.raises(TypeError, match="model: expected a model with its transformer blocks"):
        hidden_matrices(torch.nn.Linear(3, 3))


def test_a_checkpoint_of_an_unknown_architecture_is_refused(tmp_path, monkeypatch):
    import course_lib.checkpoints as checkpoints
    tok, _, _ = _splits()
    path = save_checkpoint(tmp_path / "g.pt", _gpt(tok.vocab_size), tok)
    monkeypatch.setattr(checkpoints, "ARCHITECTURES", {"modern": checkpoints.ARCHITECTURES["modern"]})
    with pytest.raises(CheckpointError, match="unknown architecture 'gpt'"):
        load_checkpoint(path)
