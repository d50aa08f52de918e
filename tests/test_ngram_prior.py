"""The counted n-gram model: Kneser-Ney as counted by hand, leave-one-out, and its place in ModernGPT."""
import time
from collections import Counter

import pytest
import torch

from course_lib.checkpoints import load_checkpoint, save_checkpoint
from course_lib.data import IGNORE_INDEX, CharTokenizer, Examples, TokenStream
from course_lib.generate import generate
from course_lib.modern_gpt import ModernGPT, ModernGPTConfig
from course_lib.ngram_prior import NgramPrior
from course_lib.train import TrainConfig, train

V, ORDER = 5, 4
CONFIG = dict(vocab_size=V, max_tokens=12, embed_dim=16, num_heads=2, num_layers=1, mlp="relu2")


def _text(length=400, seed=0):
    """Random text with repeats, so that counts of 1, 2 and more all occur."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(V, (7,), generator=g)
    parts = [motif if torch.rand(1, generator=g) < 0.3 else torch.randint(V, (7,), generator=g)
             for _ in range(length // 7)]
    return torch.cat(parts)


def _window(seed):
    return torch.randint(V, (1, 12), generator=torch.Generator().manual_seed(seed))


def _by_hand(text, discounts, history, target=None):
    """Interpolated Kneser-Ney after ``history``, counted with dicts; with ``target``, that occurrence left out."""
    text = text.tolist()
    raw = {m: Counter(tuple(text[i - m + 1:i + 1]) for i in range(m - 1, len(text))) for m in range(1, ORDER + 1)}
    if target is not None:
        for m in range(2, ORDER + 1):              # every n-gram ending at the target that the history holds
            if m - 1 <= len(history):
                gram = tuple(history[len(history) - (m - 1):]) + (target,)
                if raw[m][gram] > 0:
                    raw[m][gram] -= 1

    def count(k, gram):
        if k == ORDER:
            return raw[k][gram]
        return sum(1 for longer, c in raw[k + 1].items() if c > 0 and longer[1:] == gram)   # continuation

    probs = [1.0 / V] * V
    for k in range(1, ORDER + 1):
        if k - 1 > len(history):
            break
        context = tuple(history[len(history) - (k - 1):]) if k > 1 else ()
        counts = [count(k, context + (v,)) for v in range(V)]
        total = sum(counts)
        if total > 0:
            d = [float(discounts[k - 1][min(c, 3) - 1]) if c > 0 else 0.0 for c in counts]
            probs = [(c - dc) / total + sum(d) / total * p for c, dc, p in zip(counts, d, probs)]
    return probs


def _counted(text=None):
    prior = NgramPrior(V, ORDER)
    prior.count(_text() if text is None else text)
    return prior


def test_the_probabilities_are_kneser_ney_counted_by_hand():
    text = _text()
    prior = _counted(text)
    window = _window(seed=1)                     # (1, 12): text the counts may not have seen
    got = prior(window).exp()[0]                         # (12, V)
    for j in range(12):
        want = torch.tensor(_by_hand(text, prior.discounts, window[0, :j + 1].tolist()))
        assert torch.allclose(got[j], want, atol=1e-5), j


def test_leaving_one_out_is_counting_without_that_occurrence():
    text = _text()
    prior = _counted(text)
    start = 100
    window, targets = text[start:start + 12][None], text[start + 1:start + 13][None]   # a window of the counted text
    got = prior(window, targets).exp()[0]
    for j in range(12):
        want = torch.tensor(_by_hand(text, prior.discounts, window[0, :j + 1].tolist(), int(targets[0, j])))
        assert torch.allclose(got[j], want, atol=1e-5), j
    # and it matters: left in, its own occurrence makes every target likelier
    assert bool((prior(window).exp()[0].gather(1, targets.T) > got.gather(1, targets.T)).any())


def test_a_padded_target_or_one_never_counted_is_not_left_out():
    prior = _counted()
    window = _window(seed=1)
    unseen = torch.full((1, 12), IGNORE_INDEX)
    assert torch.equal(prior(window, unseen), prior(window))


def test_every_distribution_sums_to_one_and_the_discounts_are_chen_and_goodmans():
    prior = _counted(_text(3000))
    probs = prior(torch.randint(V, (3, 12))).exp()
    assert torch.allclose(probs.sum(-1), torch.ones(3, 12), atol=1e-5)
    counts = prior.entry_counts_4                         # the longest order counts occurrences
    n1, n2, n3, n4 = (float((counts == r).sum()) for r in (1, 2, 3, 4))
    y = n1 / (n1 + 2 * n2)
    want = [1 - 2 * y * n2 / n1, 2 - 3 * y * n3 / n2, 3 - 4 * y * n4 / n3]
    assert prior.discounts[3].tolist() == pytest.approx(want, abs=1e-6)
    assert 0 < want[0] < want[1] < want[2] < 3


def test_an_uncounted_prior_is_uniform():
    prior = NgramPrior(V, ORDER)
    assert torch.allclose(prior(torch.zeros(1, 3, dtype=torch.long)).exp(), torch.full((1, 3, V), 1 / V))


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return ModernGPT(ModernGPTConfig(**{**CONFIG, "ngram_prior": ORDER, **overrides}))


def test_the_logits_are_the_networks_plus_the_counted_log_probabilities():
    torch.manual_seed(0)
    plain = ModernGPT(ModernGPTConfig(**CONFIG)).eval()
    model = _model().eval()
    idx = torch.randint(V, (2, 12))
    # uncounted, the prior adds the same number to every logit: the model predicts what it would without it
    assert torch.allclose(model(idx).softmax(-1), plain(idx).softmax(-1), atol=1e-6)
    model.ngram_prior.count(_text())
    assert torch.allclose(model(idx), plain(idx) + model.ngram_prior(idx), atol=1e-5)


def test_reading_the_counts_at_the_input_starts_at_zero_and_learns():
    torch.manual_seed(0)
    without = _model().eval()
    model = _model(prior_features=True)
    model.ngram_prior.count(_text())
    without.ngram_prior.count(_text())
    idx, targets = _text()[:48].view(4, 12), _text()[1:49].view(4, 12)
    # drawn after every other weight and starting at zero: a fresh model is the model without it
    assert torch.equal(model.eval()(idx), without(idx))
    logits = model.train()(idx, targets=targets)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    assert model.prior_in.weight.grad.abs().sum() > 0


def test_only_training_leaves_targets_out():
    model = _model()
    model.ngram_prior.count(_text())
    idx, targets = _text()[100:112][None], _text()[101:113][None]
    model.train()
    left_out = model(idx, targets=targets)
    model.eval()
    assert torch.equal(model(idx, targets=targets), model(idx))   # scoring never leaves anything out
    assert not torch.allclose(left_out, model(idx))


def test_the_weight_on_the_counts_learns_and_the_counts_do_not():
    model = _model().train()
    model.ngram_prior.count(_text())
    idx, targets = _text()[:48].view(4, 12), _text()[1:49].view(4, 12)
    logits = model(idx, targets=targets)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    assert model.prior_weight.grad is not None and model.prior_weight.grad.abs() > 0
    assert all(not b.requires_grad for b in model.ngram_prior.buffers())


def test_generation_with_a_cache_is_generation_without():
    model = _model().eval()
    model.ngram_prior.count(_text())
    prompt = torch.randint(V, (2, 2), generator=torch.Generator().manual_seed(2))
    # 30 new tokens run past max_tokens=12, so the window slides and the cache starts again too
    cached = generate(model, prompt, 30, temperature=0, use_cache=True)
    assert torch.equal(cached, generate(model, prompt, 30, temperature=0, use_cache=False))
    cache = model.new_cache()
    idx = _window(seed=3)
    pieces = [model(idx[:, :2], cache), model(idx[:, 2:3], cache), model(idx[:, 3:], cache)]
    assert torch.allclose(torch.cat(pieces, dim=1), model(idx), atol=1e-5)


def test_a_checkpoint_keeps_the_counts(tmp_path):
    model = _model().eval()
    model.ngram_prior.count(_text())
    tokenizer = CharTokenizer.from_text("abcde")
    loaded = load_checkpoint(save_checkpoint(tmp_path / "m.pt", model, tokenizer)).model.eval()
    idx = torch.randint(V, (2, 12))
    assert loaded.ngram_prior.counted and torch.equal(loaded(idx), model(idx))


def test_training_counts_the_training_text_once_and_leaves_each_target_out(monkeypatch):
    model = _model()
    split = TokenStream(_text())
    seen = []
    forward = NgramPrior.forward

    def spy(self, idx, targets=None, before=None):
        seen.append(targets is not None)
        return forward(self, idx, targets, before)

    count = NgramPrior.count

    def slow_count(self, ids):   # counting is training: its time is training time
        time.sleep(0.5)
        count(self, ids)

    monkeypatch.setattr(NgramPrior, "forward", spy)
    monkeypatch.setattr(NgramPrior, "count", slow_count)
    config = TrainConfig(steps=3, batch_size=2, eval_interval=3, eval_windows=2, warmup_steps=1)
    history = train(model, split, TokenStream(_text(100, seed=5)), config, progress=False)
    assert history.train_seconds >= 0.5
    assert int(model.ngram_prior.counted_tokens) == split.ids.numel()
    assert seen.count(True) == 3                       # each training step left its targets out
    assert not all(seen)                               # and the evaluations did not
    before = model.ngram_prior.entry_counts_4.clone()
    train(model, TokenStream(_text(100, seed=6)), None, TrainConfig(steps=1, batch_size=2, warmup_steps=1),
          progress=False)
    assert torch.equal(model.ngram_prior.entry_counts_4, before)   # counted already: not counted again


def test_count_ngrams_counts_once_and_names_what_it_cannot_count():
    from course_lib.train import count_ngrams, has_ngram_prior
    model = _model()
    assert has_ngram_prior(model) and not has_ngram_prior(ModernGPT(ModernGPTConfig(**CONFIG)))
    assert count_ngrams(model, TokenStream(_text())) > 0 and model.ngram_prior.counted
    assert count_ngrams(model, TokenStream(_text())) == 0.0                    # counted already
    torch.manual_seed(0)
    assert count_ngrams(ModernGPT(ModernGPTConfig(**CONFIG)), TokenStream(_text())) == 0.0   # nothing to count
    with pytest.raises(TypeError, match="train_split: a model with a counted n-gram model .* got list"):
        count_ngrams(_model(), [1, 2, 3])
    with pytest.raises(TypeError, match="model: expected an nn.Module"):
        count_ngrams("gpt", TokenStream(_text()))


def test_names_are_counted_one_row_after_another():
    model = _model(max_tokens=6)
    inputs = torch.tensor([[0, 1, 2, 3, 0, 0], [0, 4, 3, 0, 0, 0]])
    targets = torch.tensor([[1, 2, 3, 0, IGNORE_INDEX, IGNORE_INDEX], [4, 3, 0, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]])
    train(model, Examples(inputs, targets), None, TrainConfig(steps=1, batch_size=2, warmup_steps=1), progress=False)
    assert int(model.ngram_prior.counted_tokens) == 5 + 4


@pytest.mark.parametrize("value", [-1, True, 2.0])
def test_the_config_names_a_bad_order(value):
    with pytest.raises(ValueError, match="ngram_prior: expected 0 .none. or an int >= 1"):
        ModernGPTConfig(**{**CONFIG, "ngram_prior": value})


def test_reading_counts_that_are_not_there_is_refused():
    with pytest.raises(ValueError, match="prior_features: the network reads the counted model's probabilities, "
                                         "so it needs one; set ngram_prior"):
        ModernGPTConfig(**{**CONFIG, "prior_features": True})
    with pytest.raises(TypeError, match="prior_features"):
        ModernGPTConfig(**{**CONFIG, "ngram_prior": 3, "prior_features": "yes"})


def test_the_prior_names_a_bad_setting_or_input():
    with pytest.raises(ValueError, match="order: expected an int >= 1"):
        NgramPrior(5, 0)
    with pytest.raises(ValueError, match=r"order: 12 tokens of a vocabulary of 50000 do not fit a 64-bit key; "
                                         r"expected an order of at most 3"):
        NgramPrior(50000, 12)
    prior = NgramPrior(5, 3)
    with pytest.raises(ValueError, match="ids: .*5"):
        prior.count(torch.tensor([0, 1, 7]))
    with pytest.raises(ValueError, match="ids: expected at least 2 tokens"):
        prior.count(torch.tensor([1]))
    model = _model().train()
    with pytest.raises(ValueError, match=r"targets: expected the shape of idx \(1, 4\), got \(1, 3\)"):
        model(torch.zeros(1, 4, dtype=torch.long), targets=torch.zeros(1, 3, dtype=torch.long))


def test_llama_cannot_express_counted_ngrams():
    from course_lib.hf.llama import llama_config_from_course
    with pytest.raises(ValueError, match=r"config.ngram_prior: a Llama cannot express ngram_prior=4"):
        llama_config_from_course(ModernGPTConfig(**{**CONFIG, "mlp": "swiglu", "ngram_prior": 4}))
