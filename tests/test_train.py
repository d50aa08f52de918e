"""Loss, training step, evaluation, schedule, the loop, presets and checkpoints."""
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from course_lib import GPT, GPTConfig
from course_lib.checkpoints import load_checkpoint, save_checkpoint
from course_lib.data import CharTokenizer, Examples, TokenStream, lm_windows
from course_lib.runs import PRESETS, prepare_preset, run_preset
from course_lib.train import (
    TrainConfig,
    evaluate,
    flops_per_token,
    learning_rate,
    lm_loss,
    train,
    train_step,
)

TEXT = "the cat sat on the mat. the dog sat on the log. " * 40


def tiny_model(vocab_size, max_tokens=16):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, max_tokens=max_tokens, embed_dim=32, num_heads=2, num_layers=2))


def test_lm_loss_is_mean_cross_entropy_and_ignores_padding():
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, 2, -100], [0, -100, 4]])
    keep = targets != -100
    expected = -logits.log_softmax(-1)[keep].gather(-1, targets[keep][:, None]).mean()
    assert torch.isclose(lm_loss(logits, targets), expected)
    uniform = lm_loss(torch.zeros(1, 4, 7), torch.zeros(1, 4, dtype=torch.long))
    assert math.isclose(uniform.item(), math.log(7), rel_tol=1e-6)


@pytest.mark.parametrize("logits,targets,match", [
    (torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.long), "logits"),
    (torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), "targets"),
    (torch.randn(2, 3, 5), torch.zeros(2, 3), "targets"),
])
def test_lm_loss_bad_input(logits, targets, match):
    with pytest.raises((TypeError, ValueError), match=match):
        lm_loss(logits, targets)


def test_train_step_updates_weights_and_lowers_loss_on_the_same_batch():
    tok = CharTokenizer.from_text(TEXT)
    model = tiny_model(tok.vocab_size)
    x, y = lm_windows(torch.tensor(tok.encode(TEXT)), 16)
    x, y = x[:8], y[:8]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = model.head.weight.detach().clone()
    losses = [train_step(model, optimizer, x, y) for _ in range(15)]
    assert isinstance(losses[0], float)
    assert not torch.equal(before, model.head.weight)
    assert losses[-1] < losses[0] - 0.5


def test_evaluate_counts_every_token_once():
    model = tiny_model(5).eval()
    x = torch.randint(0, 5, (7, 16))
    y = torch.randint(0, 5, (7, 16))
    y[0, :4] = -100
    logits = model(x)
    expected = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100).item()
    assert math.isclose(evaluate(model, x, y, batch_size=3), expected, rel_tol=1e-5)


def test_learning_rate_warms_up_then_decays_to_the_minimum():
    config = TrainConfig(steps=100, learning_rate=1e-3, min_learning_rate=1e-4, warmup_steps=10)
    warm = [learning_rate(config, s, 0.0) for s in range(10)]
    assert warm == sorted(warm) and warm[-1] < 1e-3
    assert math.isclose(learning_rate(config, 10, 0.0), 1e-3)
    assert math.isclose(learning_rate(config, 50, 0.5), 5.5e-4)
    assert math.isclose(learning_rate(config, 99, 1.0), 1e-4)


def test_flops_per_token_known_config():
    # the baseline recipe: 4 layers, 4 heads of 32, context 64
    config = GPTConfig(vocab_size=65, max_tokens=64, embed_dim=128, num_heads=4, num_layers=4)
    assert flops_per_token(config, 1_000_000) == 6_000_000 + 12 * 4 * 4 * 32 * 64


def test_flops_per_token_names_the_wrong_argument():
    config = GPTConfig(vocab_size=65, max_tokens=64, embed_dim=128, num_heads=4, num_layers=4)
    with pytest.raises(TypeError, match="config: expected a GPTConfig or ModernGPTConfig, got dict"):
        flops_per_token(config.to_dict(), 1_000_000)
    with pytest.raises(ValueError, match="num_parameters"):
        flops_per_token(config, 0)


def test_training_loop_lowers_the_loss_and_records_history():
    tok = CharTokenizer.from_text(TEXT)
    ids = torch.tensor(tok.encode(TEXT))
    model = tiny_model(tok.vocab_size)
    config = TrainConfig(steps=80, batch_size=8, learning_rate=3e-3, warmup_steps=5, eval_interval=40,
                         eval_windows=10, log_interval=10)
    history = train(model, TokenStream(ids[:1600]), TokenStream(ids[1600:]), config, device="cpu", progress=False)
    assert history.steps_taken == 80
    assert history.step[0] == 1 and history.step[-1] == 80
    assert history.val_step == [40, 80]
    assert history.train_loss[-1] < history.train_loss[0] - 1.0
    assert history.tokens_seen == 80 * 8 * 16


def test_training_stops_on_the_wall_clock():
    tok = CharTokenizer.from_text(TEXT)
    ids = torch.tensor(tok.encode(TEXT))
    config = TrainConfig(steps=100_000, seconds=0.5, batch_size=4, warmup_steps=0)
    history = train(tiny_model(tok.vocab_size), TokenStream(ids), None, config, device="cpu", progress=False)
    assert 0 < history.steps_taken < 100_000


def test_examples_split_samples_rows():
    inputs = torch.arange(12).view(4, 3)
    split = Examples(inputs, inputs + 1)
    x, y = split.sample(6, 3, torch.Generator().manual_seed(0))
    assert x.shape == (6, 3) and torch.equal(y, x + 1)
    assert torch.equal(split.eval_windows(3)[0], inputs)


def test_checkpoint_round_trip_gives_identical_logits(tmp_path):
    tok = CharTokenizer.from_text(TEXT)
    model = tiny_model(tok.vocab_size).eval()
    path = save_checkpoint(tmp_path / "ck.pt", model, tok, extra={"val_loss": 1.5})
    loaded = load_checkpoint(path)
    idx = torch.randint(0, tok.vocab_size, (2, 10))
    assert torch.equal(loaded.model.eval()(idx), model(idx))
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("the cat")) == "the cat"
    assert loaded.extra == {"val_loss": 1.5}
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]   # no temporary file left behind


def test_checkpoint_with_a_different_config_fails_clearly(tmp_path):
    path = save_checkpoint(tmp_path / "ck.pt", tiny_model(7))
    other = GPT(GPTConfig(vocab_size=7, max_tokens=16, embed_dim=64, num_heads=2, num_layers=2))
    with pytest.raises(ValueError, match="embed_dim: checkpoint has 32, your model has 64"):
        load_checkpoint(path, model=other)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pt is not a course checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    with pytest.raises(FileNotFoundError, match="path"):
        load_checkpoint(tmp_path / "missing.pt")


def test_subword_tokenizer_survives_a_checkpoint(tmp_path):
    from course_lib.data import train_subword_tokenizer
    tok = train_subword_tokenizer(TEXT, vocab_size=300)
    path = save_checkpoint(tmp_path / "ck.pt", tiny_model(len(tok)), tok)
    loaded = load_checkpoint(path).tokenizer
    assert loaded.encode("the dog sat") == tok.encode("the dog sat")


def test_every_preset_builds_with_a_text_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 5)
    for name in PRESETS:
        if name == "names_char":
            continue
        model, tok, train_split, val_split, config = prepare_preset(name, corpus=str(corpus), device="cpu")
        assert model.config.vocab_size == tok.vocab_size
        assert not config.amp and not config.compile   # GPU switches are dropped on a CPU
    with pytest.raises(ValueError, match="preset"):
        prepare_preset("huge")


def test_baseline_preset_is_the_published_recipe():
    p = PRESETS["baseline_cpu"]
    assert (p.model["num_layers"], p.model["num_heads"], p.model["embed_dim"], p.model["max_tokens"]) == (4, 4, 128, 64)
    t = p.train
    assert (t.batch_size, t.steps, t.learning_rate, t.min_learning_rate, t.warmup_steps, t.beta2) == \
        (12, 2000, 1e-3, 1e-4, 100, 0.99)
    assert p.model["dropout_rate"] == 0.0 and not p.model["tie_weights"]


def test_run_preset_writes_metrics_and_a_loadable_checkpoint(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 5)
    metrics = run_preset("tiny", tmp_path / "out", steps=30, corpus=str(corpus), device="cpu", progress=False)
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    for key in ("val_loss", "train_seconds", "tokens_per_second", "parameters", "steps"):
        assert saved[key] == metrics[key]
    assert saved["steps"] == 30 and saved["val_loss"] < math.log(saved["model"]["vocab_size"])
    loaded = load_checkpoint(tmp_path / "out" / "checkpoint.pt")
    assert loaded.model.num_parameters() == saved["parameters"]


def test_train_config_validates():
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="seconds"):
        TrainConfig(seconds=-1)


# ---------------------------------------------------------------- guarded, resumable training

from course_lib.checkpoints import CheckpointError
from course_lib.data import random_batch
from course_lib.train import NonFiniteLoss, TrainState


def _splits():
    tok = CharTokenizer.from_text(TEXT)
    ids = torch.tensor(tok.encode(TEXT))
    return tok, TokenStream(ids[:1600]), TokenStream(ids[1600:])


def _dropout_model(vocab_size):
    # dropout, so the resumed run must also restore the global RNG, not only the batcher's
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, max_tokens=16, embed_dim=32, num_heads=2, num_layers=2,
                         dropout_rate=0.1))


def test_interrupted_and_resumed_training_follows_the_uninterrupted_trajectory(tmp_path):
    tok, train_split, val_split = _splits()
    config = TrainConfig(steps=40, batch_size=4, learning_rate=3e-3, warmup_steps=5, eval_interval=10,
                         eval_windows=8, log_interval=3)
    whole = train(_dropout_model(tok.vocab_size), train_split, val_split, config, device="cpu", progress=False)

    # the first part stops after step 17: between evaluations and between two logged means
    model = _dropout_model(tok.vocab_size)
    saved = []
    train(model, train_split, val_split, config, device="cpu", progress=False,
          on_checkpoint=lambda state: saved.append(save_checkpoint(
              tmp_path / f"ck{state.step}.pt", model, tok, training=state.to_dict())),
          should_stop=_stop_after(17))
    last = load_checkpoint(saved[-1])
    assert last.training["step"] == 17
    torch.manual_seed(123)   # whatever the global RNG holds now must not matter
    resumed = train(last.model, train_split, val_split, config, device="cpu", progress=False,
                    state=TrainState.from_dict(last.training))

    assert resumed.step == whole.step and resumed.val_step == whole.val_step
    assert resumed.tokens_seen == whole.tokens_seen and resumed.steps_taken == 40
    # Same batches, same dropout masks, same optimizer moments, and the same CPU kernels with the
    # same thread count in the same order: the trajectories are bit-for-bit equal (measured max
    # difference 0.0 with 2 threads). 1e-6 leaves room only for a float reduction order that a
    # different thread count could change; a missed RNG, optimizer or schedule state moves the
    # loss by 1e-2 or more from the first step after the resume (checked by breaking each).
    train_gap = max(abs(a - b) for a, b in zip(resumed.train_loss, whole.train_loss))
    val_gap = max(abs(a - b) for a, b in zip(resumed.val_loss, whole.val_loss))
    assert train_gap <= 1e-6 and val_gap <= 1e-6, (train_gap, val_gap)


def _stop_after(steps):
    # train() asks before every step: the (steps + 1)-th question comes once `steps` are done
    asked = []

    def should_stop():
        asked.append(1)
        return len(asked) > steps
    return should_stop


def test_a_nan_loss_stops_the_run_and_no_checkpoint_after_the_last_good_one(monkeypatch):
    tok, train_split, val_split = _splits()
    model = tiny_model(tok.vocab_size)
    config = TrainConfig(steps=60, batch_size=4, warmup_steps=0, eval_interval=10, eval_windows=4, log_interval=5)
    calls = []
    original = model.forward

    def poisoned(idx, cache=None):   # weights turn NaN during step 23, as a too-high learning rate would
        calls.append(1)
        if model.training and len(calls) == 23 + 2:   # + the forward calls of the two evaluations
            with torch.no_grad():
                model.head.weight.fill_(float("nan"))
        return original(idx, cache)
    monkeypatch.setattr(model, "forward", poisoned)
    saved_steps = []
    with pytest.raises(NonFiniteLoss, match=r"step 2[3-5]: the training loss became NaN or infinite. "
                                            r"Likely causes: a learning rate too high \(learning_rate=0.001.*"
                                            r"bad data.*dropout applied after the causal mask"):
        train(model, train_split, val_split, config, device="cpu", progress=False,
              on_checkpoint=lambda state: saved_steps.append(state.step))
    assert saved_steps == [10, 20]


@pytest.mark.slow
def test_run_preset_keeps_the_last_good_checkpoint_when_the_loss_turns_nan(tmp_path, monkeypatch):
    import course_lib.train as train_module
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 5)
    real_update, steps = train_module.update, []

    def update(*args, **kwargs):
        steps.append(1)
        loss = real_update(*args, **kwargs)
        return loss * float("nan") if len(steps) > 55 else loss
    monkeypatch.setattr(train_module, "update", update)
    with pytest.raises(NonFiniteLoss, match=r"last good checkpoint is kept in .*checkpoint\.pt"):
        run_preset("tiny", tmp_path / "run", steps=150, corpus=str(corpus), device="cpu", progress=False)
    kept = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert kept.training["step"] == metrics["step"] == 50   # the evaluation before the NaN
    assert kept.training["run_id"] == metrics["run_id"]
    # a script tells this run from a live one: metrics.json says it failed, and why
    assert metrics["status"] == "failed" and "loss" in metrics["failure"]


@pytest.mark.parametrize("field,value", [
    ("max_grad_norm", -1.0), ("max_grad_norm", 0.0), ("min_learning_rate", -1e-4), ("learning_rate", math.inf),
    ("learning_rate", math.nan), ("min_learning_rate", 1.0), ("beta1", 1.0), ("beta2", -0.1),
    ("weight_decay", -0.1), ("seconds", math.inf), ("seed", -1), ("checkpoint_seconds", 0), ("amp", "yes"),
    ("patience", 0), ("patience", 1.5),
])
def test_train_config_refuses_values_that_would_train_badly(field, value):
    # _validate's vocabulary: a value of the wrong type (a str for a switch) is a TypeError
    with pytest.raises((ValueError, TypeError), match=f"^{field}: expected .*got {re.escape(repr(value))}"):
        TrainConfig(**{field: value})


def test_train_refuses_splits_that_are_not_splits_or_do_not_fit_the_model():
    tok, train_split, _ = _splits()
    config = TrainConfig(steps=2, batch_size=2)
    with pytest.raises(TypeError, match="train_split: expected a split with sample.. and eval_windows.. "
                                        r"\(TokenStream or Examples\), got Tensor"):
        train(tiny_model(tok.vocab_size), train_split.ids, None, config, device="cpu", progress=False)
    with pytest.raises(ValueError, match=rf"train_split inputs: expected token ids in 0..4 \(vocab_size=5\), "
                                         rf"got {tok.vocab_size - 1}.*vocab_size=tokenizer.vocab_size"):
        train(tiny_model(5), train_split, None, config, device="cpu", progress=False)


def test_the_loop_and_train_step_share_one_batcher_and_one_step():
    ids = torch.arange(500) % 37
    stream = TokenStream(ids)
    x, y = stream.sample(6, 8, torch.Generator().manual_seed(3))
    # the draws of the batcher the loop always used: randint(len - max_tokens) on the CPU generator
    starts = torch.randint(500 - 8, (6,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(x, ids[starts[:, None] + torch.arange(8)])
    x2, y2 = random_batch(ids, 6, 8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_lm_loss_names_out_of_vocabulary_targets():
    with pytest.raises(ValueError, match=r"targets: expected token ids in 0..4 \(vocab_size=5\), got 9"):
        lm_loss(torch.randn(1, 3, 5), torch.tensor([[1, 9, -100]]))


def test_resume_with_a_bigger_budget_and_refusals(tmp_path):
    from course_lib.runs.run_folder import RunRefused
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 5)
    out = tmp_path / "run"
    first = run_preset("tiny", out, steps=20, corpus=str(corpus), device="cpu", progress=False)
    with pytest.raises(RunRefused, match="already holds a run .*--resume .*--overwrite"):
        run_preset("tiny", out, steps=20, corpus=str(corpus), device="cpu", progress=False)
    more = run_preset(None, out, steps=30, device="cpu", progress=False, resume=True)
    assert more["steps"] == 30 and more["run_id"] == first["run_id"] and more["history"]["step"][0] == 1
    assert load_checkpoint(out / "checkpoint.pt").training["step"] == 30
    with pytest.raises(RunRefused, match="preset: the run in .* is preset 'tiny', got 'baseline_cpu'"):
        run_preset("baseline_cpu", out, steps=40, device="cpu", progress=False, resume=True)
    data = bytearray((out / "checkpoint.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / "checkpoint.pt").write_bytes(bytes(data))
    with pytest.raises(RunRefused, match=r"resume: path: .*checkpoint.pt is damaged"):
        run_preset(None, out, steps=40, device="cpu", progress=False, resume=True)
    with pytest.raises(CheckpointError):
        load_checkpoint(out / "checkpoint.pt")
    fresh = run_preset("tiny", out, steps=5, corpus=str(corpus), device="cpu", progress=False, overwrite=True)
    assert fresh["run_id"] != first["run_id"] and fresh["steps"] == 5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shakespeare_char_gpu", "shakespeare_char_modern_gpu"])
def test_the_gpu_recipe_code_path_runs_on_a_cpu(name):
    # the GPU recipes as the GPU runs them (compiled or not as the preset says, fused AdamW or Muon, their
    # models), minus what a CPU cannot do (bf16 autocast, pinned memory), for a few steps: breakage shows
    # without a GPU. (Compiling on a CPU costs about 40 s, so only the recipe that compiles does.)
    from dataclasses import replace
    model, tok, train_split, val_split, config = prepare_preset(name, corpus=None, device="cpu",
                                                                compile=PRESETS[name].train.compile)
    assert config.compile == PRESETS[name].train.compile and not config.amp
    assert replace(PRESETS[name].train, amp=False, pin_memory=False) == config
    # no warmup: three steps at the full learning rate, so that learning shows above dropout's noise
    config = replace(config, steps=3, batch_size=2, eval_interval=2, eval_windows=2, log_interval=1, warmup_steps=0)
    history = train(model, train_split, val_split, config, device="cpu", progress=False)
    assert history.steps_taken == 3 and all(math.isfinite(v) for v in history.train_loss + history.val_loss)
    assert history.train_loss[-1] < history.train_loss[0]


def test_a_run_stopped_by_a_signal_and_resumed_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 5)
    common = dict(steps=70, corpus=str(corpus), device="cpu", progress=False)
    whole = run_preset("tiny", tmp_path / "whole", **common)

    class SignalAfter37Steps:   # SIGTERM arriving during step 37, as StopRequest reports it
        name, signum = "SIGTERM", 15

        def __enter__(self):
            self.asked = 0
            return self

        def __exit__(self, *exc):
            pass

        def __call__(self):
            self.asked += 1
            return self.asked > 37
    monkeypatch.setattr("course_lib.runs.presets.StopRequest", SignalAfter37Steps)
    stopped = run_preset("tiny", tmp_path / "split", **common)
    assert stopped["status"] == "stopped" and stopped["steps"] == 37 and stopped["signal"] == "SIGTERM"
    monkeypatch.undo()
    resumed = run_preset(None, tmp_path / "split", steps=70, device="cpu", progress=False, resume=True)
    assert resumed["status"] == "finished" and resumed["run_id"] == stopped["run_id"]
    for key in ("step", "val_step"):
        assert resumed["history"][key] == whole["history"][key]
    # exact here too (see the test above); the final evaluation runs over the same weights
    for key in ("train_loss", "val_loss"):
        gap = max(abs(a - b) for a, b in zip(resumed["history"][key], whole["history"][key]))
        assert gap <= 1e-6, (key, gap)
    assert abs(resumed["val_loss"] - whole["val_loss"]) <= 1e-6


def test_checkpoints_come_on_the_clock_too_not_only_at_evaluations():
    tok, train_split, val_split = _splits()
    config = TrainConfig(steps=5, batch_size=2, eval_interval=1000, checkpoint_seconds=1e-9)
    saved = []
    history = train(tiny_model(tok.vocab_size), train_split, val_split, config, device="cpu", progress=False,
                    on_checkpoint=lambda state: saved.append((state.step, state.history.checkpoint_seconds)))
    # no evaluation falls in these 5 steps: every checkpoint here is the clock's (and the final one)
    assert [step for step, _ in saved] == [0, 1, 2, 3, 4, 5]
    assert history.checkpoint_seconds >= saved[-1][1] > 0 and history.stop_reason == "steps"


def test_evaluate_refuses_targets_that_are_all_padding():
    model = GPT(GPTConfig(vocab_size=6, max_tokens=4, embed_dim=8, num_heads=2, num_layers=1))
    inputs = torch.zeros(3, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"targets: expected at least one target that is not padding \(-100\)"):
        evaluate(model, inputs, torch.full((3, 4), -100))
    one = torch.full((3, 4), -100)
    one[1, 2] = 5
    assert evaluate(model, inputs, one) > 0


def test_run_preset_leaves_the_callers_random_numbers_alone(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 5)
    torch.manual_seed(0)
    run_preset("tiny", tmp_path / "out", steps=2, corpus=str(corpus), device="cpu", progress=False)
    after_run = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after_run, torch.rand(3))


# ---------------------------------------------------------------- stopping chosen by validation

def _scripted_estimates(monkeypatch, losses):
    """train()'s validation estimates come from ``losses`` in turn, then from the model again."""
    import course_lib.train as training
    real, script = training._evaluate, list(losses)
    monkeypatch.setattr(training, "_evaluate", lambda *args, **kw: script.pop(0) if script else real(*args, **kw))


def _weights(model):
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _same(a, b):
    return all(torch.equal(a[name], b[name]) for name in a)


# the best at the 2nd estimate, then 2 that beat no earlier one (an equal estimate is no better)
PATIENCE_SCRIPT = [3.0, 2.0, 2.0, 2.6, 1.0, 0.5]


def _train_with_script(monkeypatch, patience, steps=40, should_stop=None, state=None, model=None):
    tok, train_split, val_split = _splits()
    _scripted_estimates(monkeypatch, PATIENCE_SCRIPT[2:] if state is not None else PATIENCE_SCRIPT)
    model = model if model is not None else _dropout_model(tok.vocab_size)
    config = TrainConfig(steps=steps, batch_size=4, learning_rate=3e-3, warmup_steps=5, eval_interval=5,
                         eval_windows=8, log_interval=5, patience=patience)
    saved = []
    history = train(model, train_split, val_split, config, device="cpu", progress=False, state=state,
                    should_stop=should_stop, on_checkpoint=lambda s: saved.append((s.step, _weights(model), s)))
    return model, history, saved


def test_patience_stops_when_the_estimates_stop_improving_and_keeps_the_best_weights(monkeypatch):
    model, history, saved = _train_with_script(monkeypatch, patience=2)
    # estimates at steps 5, 10, 15, 20: the best at 10, then two worse ones, so it stops after step 20
    assert history.stop_reason == "patience" and history.steps_taken == 20
    assert history.val_step == [5, 10, 15, 20] and (history.best_step, history.best_val_loss) == (10, 2.0)
    assert history.estimates_since_best() == 2
    at = {step: weights for step, weights, _ in saved[:-1]}
    assert [step for step, _, _ in saved] == [5, 10, 15, 20, 20]   # the last save holds the weights gone back to
    assert _same(_weights(model), at[10]) and not _same(_weights(model), at[20])
    assert _same(saved[-1][1], at[10]) and saved[-1][2].best_weights is None
    # the saves between the best estimate and the stop carry its weights, so a resumed run can go back too
    assert _same(saved[2][2].best_weights, at[10])


def test_without_patience_the_whole_budget_trains_and_the_best_estimate_is_only_recorded(monkeypatch):
    model, history, saved = _train_with_script(monkeypatch, patience=None)
    assert history.stop_reason == "steps" and history.steps_taken == 40
    assert (history.best_step, history.best_val_loss) == (30, 0.5)   # the 6th estimate, at step 30
    assert _same(_weights(model), saved[-1][1]) and all(s.best_weights is None for _, _, s in saved)


def test_a_patient_run_interrupted_and_resumed_goes_back_to_the_same_weights(monkeypatch, tmp_path):
    whole, whole_history, _ = _train_with_script(monkeypatch, patience=2)
    tok = _splits()[0]
    part, _, saved = _train_with_script(monkeypatch, patience=2, should_stop=_stop_after(12))
    path = save_checkpoint(tmp_path / "ck.pt", part, tok, training=saved[-1][2].to_dict())
    last = load_checkpoint(path)
    assert last.training["step"] == 12 and last.training["best_weights"] is not None
    resumed_model, resumed, _ = _train_with_script(monkeypatch, patience=2, model=last.model,
                                                    state=TrainState.from_dict(last.training))
    assert resumed.stop_reason == "patience" and resumed.steps_taken == 20 and resumed.best_step == 10
    assert resumed.val_step == whole_history.val_step
    assert _same(_weights(resumed_model), _weights(whole))
    # a checkpoint written before TrainState had best_weights still resumes
    older = dict(last.training)
    del older["best_weights"]
    assert TrainState.from_dict(older).best_weights is None


def test_a_run_stopped_by_patience_is_finished_for_good(tmp_path, monkeypatch, capsys):
    from dataclasses import replace
    tiny = PRESETS["tiny"]
    monkeypatch.setitem(PRESETS, "tiny", replace(tiny, train=replace(tiny.train, eval_interval=10, patience=1)))
    _scripted_estimates(monkeypatch, [2.0, 2.5])   # then the model's own: the final evaluation is real
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 5)
    from course_lib.__main__ import main
    assert main(["train", "--preset", "tiny", "--steps", "100", "--corpus", str(corpus), "--device", "cpu",
                 "--quiet", "--out", str(tmp_path / "run")]) == 0
    assert ("stopped early, at step 20 of 100: the latest validation estimate beat no earlier one, so the run "
            "kept the weights of step 10, its best") in capsys.readouterr().out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["status"] == "finished" and metrics["step"] == 20
    assert metrics["history"]["stop_reason"] == "patience" and metrics["history"]["best_step"] == 10
    assert math.isfinite(metrics["val_loss"]) and metrics["val_loss"] not in (2.0, 2.5)
    assert run_preset(None, tmp_path / "run", steps=200, device="cpu", progress=False, resume=True) == {}
    assert "already finished at step 20: the latest validation estimate beat no" in capsys.readouterr().out
