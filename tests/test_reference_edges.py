"""The reference at its edges: padded prefixes, no keys, fully masked rows, and every odd input refused in one line.

A helper that teaches the running maximum must survive a block with nothing in it; a sampler must survive a
temperature that underflows; and what cannot be computed (NaN logits, ids outside the vocabulary) is named.
"""
import math

import pytest
import torch

from course_lib.flash import flash_attention, naive_attention, online_softmax
from course_lib.generate import generate, sample_next_token
from course_lib.model import GPT, GPTConfig
from course_lib.ngram_prior import NgramPrior

INF = float("inf")


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


# ---------------------------------------------------------------- online softmax and the tiled forward

@pytest.mark.parametrize("row", [
    [-INF, -INF, 1.0, 2.0],                    # the example: a padded prefix of one whole block
    [-INF, -INF, -INF, -INF, 0.5, -1.0],       # two masked blocks, then the text
    [-INF, 3.0, -INF, -INF, -INF, 1.0],        # a masked block in the middle
    [1e4, -INF, -INF, -INF],                   # a large score, then masked blocks
    [-INF, -INF, -1e4, -INF],                  # a very negative score after a masked block
])
@pytest.mark.parametrize("block", [1, 2, 3])
def test_online_softmax_of_a_row_with_masked_blocks_equals_softmax(row, block):
    x = torch.tensor([row], dtype=torch.float64)
    got = online_softmax(x, block)
    assert not got.isnan().any()
    assert torch.allclose(got, torch.softmax(x, dim=-1))


@pytest.mark.parametrize("block", [1, 2, 5])
def test_a_fully_masked_row_gives_zeros_as_no_keys_do_in_the_naive_reference(block):
    # Stated choice: a row with nothing to attend to has no weights at all (zeros), as naive_attention gives for
    # Lk = 0, rather than torch.softmax's NaN that would poison every later sum.
    x = torch.tensor([[-INF] * 4, [0.0, 1.0, -INF, 2.0]])
    got = online_softmax(x, block)
    assert torch.equal(got[0], torch.zeros(4))
    assert torch.allclose(got[1], torch.softmax(x[1], dim=-1))


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_with_no_keys_equals_the_naive_reference(causal):
    q, k, v = torch.randn(2, 0, 4), torch.randn(2, 0, 4), torch.randn(2, 0, 3)
    assert flash_attention(q, k, v, causal=causal)[0].shape == (2, 0, 3)
    q = torch.randn(2, 3, 4)
    out, lse = flash_attention(q, k, v, block_q=2, block_k=2)
    want_out, want_lse = naive_attention(q, k, v)
    assert torch.equal(out, want_out) and torch.equal(out, torch.zeros(2, 3, 3))
    assert torch.equal(lse, want_lse)


@pytest.mark.parametrize("name", ["k", "v"])
def test_flash_and_naive_refuse_mixed_dtypes_naming_the_argument(name):
    q, k, v = torch.randn(1, 3, 4, dtype=torch.float64), torch.randn(1, 3, 4, dtype=torch.float64), \
        torch.randn(1, 3, 4, dtype=torch.float64)
    args = {"q": q, "k": k, "v": v}
    args[name] = args[name].float()
    for fn in (flash_attention, naive_attention):
        with pytest.raises(TypeError) as error:
            fn(**args)
        assert one_line(error).startswith(f"{name}: expected dtype torch.float64")


def test_flash_and_naive_refuse_a_head_dimension_of_zero():
    for fn in (flash_attention, naive_attention):
        with pytest.raises(ValueError) as error:
            fn(torch.randn(1, 3, 0), torch.randn(1, 3, 0), torch.randn(1, 3, 2))
        assert one_line(error).startswith("q: expected a head dimension d >= 1")


@pytest.mark.parametrize("args, name", [
    ((torch.randn(3, 4).tolist(), torch.randn(3, 4), torch.randn(3, 4)), "q"),
    ((torch.randn(3, 4), torch.randn(3, 5), torch.randn(3, 4)), "k"),
    ((torch.randn(3, 4), torch.randn(3, 4), torch.randn(2, 4)), "v"),
    ((torch.ones(3, 4, dtype=torch.long), torch.ones(3, 4, dtype=torch.long), torch.ones(3, 4, dtype=torch.long)), "q"),
    ((torch.randn(4), torch.randn(4), torch.randn(4)), "q"),
])
def test_naive_attention_checks_its_inputs(args, name):
    with pytest.raises((TypeError, ValueError)) as error:
        naive_attention(*args)
    assert one_line(error).startswith(f"{name}: expected")
    with pytest.raises(TypeError, match="causal: expected True or False"):
        naive_attention(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4), causal="yes")


# ---------------------------------------------------------------- the counted n-gram model

def counted_prior(vocab_size=5, order=3):
    prior = NgramPrior(vocab_size, order)
    prior.count(torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 0, 4]))
    return prior


@pytest.mark.parametrize("bad", [5, -1, 10 ** 6])
@pytest.mark.parametrize("counted", [True, False])
def test_the_prior_refuses_ids_outside_its_vocabulary(bad, counted):
    prior = counted_prior() if counted else NgramPrior(5, 3)
    idx = torch.tensor([[0, 1, bad]])
    with pytest.raises(ValueError) as error:
        prior(idx)
    assert one_line(error).startswith("idx: expected token ids in 0..4")
    with pytest.raises(ValueError) as error:
        prior(torch.tensor([[0, 1, 2]]), targets=torch.tensor([[1, bad, 3]]))
    assert one_line(error).startswith("targets: expected token ids in 0..4")
    with pytest.raises(ValueError) as error:
        prior(torch.tensor([[0, 1, 2]]), before=torch.tensor([[bad, 1]]))
    assert one_line(error).startswith("before: expected token ids in 0..4")


def test_the_prior_still_takes_padded_targets():
    prior = counted_prior()
    out = prior(torch.tensor([[0, 1, 2]]), targets=torch.tensor([[1, -100, 3]]))
    assert out.shape == (1, 3, 5) and torch.isfinite(out).all()


# ---------------------------------------------------------------- sampling

@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 1e-300, 5e-324])
def test_a_temperature_that_underflows_is_greedy_not_a_crash(temperature):
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, -INF, 0.0, 2.5]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert torch.equal(sample_next_token(logits, temperature=temperature, generator=gen), torch.tensor([1, 0]))


@pytest.mark.parametrize("temperature", [1e-40, 1e300, 1e-5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_any_positive_temperature_samples_a_token_in_every_dtype(temperature, dtype):
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]], dtype=dtype)
    token = sample_next_token(logits, temperature=temperature, top_k=3, top_p=0.9)
    assert 0 <= int(token) < 4


@pytest.mark.parametrize("logits, what", [
    (torch.tensor([[0.0, float("nan"), 1.0]]), "NaN"),
    (torch.tensor([[0.0, INF, 1.0]]), "inf"),
    (torch.tensor([[0.0, 1.0, 2.0], [-INF, -INF, -INF]]), "-inf"),
    (torch.zeros(2, 0), "empty"),
])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_logits_that_cannot_be_sampled_are_refused_in_one_line(logits, what, temperature):
    with pytest.raises(ValueError) as error:
        sample_next_token(logits, temperature=temperature)
    text = one_line(error)
    assert text.startswith("logits: expected"), text


def tiny_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=7, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1))


@pytest.mark.parametrize("stop", ["a", -1, 7, 99, 1.5, True, torch.tensor([1, 2])])
def test_generate_validates_stop_token(stop):
    with pytest.raises((TypeError, ValueError)) as error:
        generate(tiny_model(), torch.zeros(1, 2, dtype=torch.long), 3, stop_token=stop)
    assert one_line(error).startswith("stop_token: expected None or a token id in 0..6")


def test_generate_takes_a_numpy_or_tensor_integer_stop_token():
    np = pytest.importorskip("numpy")
    for stop in (np.int64(3), torch.tensor(3), 0, 6):
        out = generate(tiny_model(), torch.zeros(1, 2, dtype=torch.long), 3, stop_token=stop, temperature=0)
        assert out.shape[1] <= 5


@pytest.mark.parametrize("use_cache", ["no", 0, 1, None])
def test_generate_wants_use_cache_as_a_bool(use_cache):
    with pytest.raises(TypeError) as error:
        generate(tiny_model(), torch.zeros(1, 2, dtype=torch.long), 3, use_cache=use_cache)
    assert one_line(error).startswith("use_cache: expected True or False")


@pytest.mark.parametrize("temperature", [1e-40, 5e-324])
def test_generate_with_an_underflowing_temperature_is_greedy(temperature):
    model = tiny_model()
    idx = torch.zeros(1, 2, dtype=torch.long)
    assert torch.equal(generate(model, idx, 5, temperature=temperature), generate(model, idx, 5, temperature=0))


def test_generate_names_a_model_whose_logits_are_not_finite():
    model = tiny_model()
    with torch.no_grad():
        model.head.weight.fill_(math.nan)
    with pytest.raises(ValueError) as error:
        generate(model, torch.zeros(1, 2, dtype=torch.long), 3)
    assert one_line(error).startswith("logits: expected")
