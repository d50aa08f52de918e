"""Sampling rules and generation, with and without the KV cache."""
import pytest
import torch

from course_lib import GPT, GPTConfig
from course_lib.data import CharTokenizer
from course_lib.generate import generate, generate_text, generate_with_cache, sample_next_token


def model_with(max_tokens=16, vocab_size=11):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, max_tokens=max_tokens, embed_dim=32, num_heads=4, num_layers=2))


def test_temperature_zero_is_argmax():
    logits = torch.randn(4, 9)
    assert torch.equal(sample_next_token(logits, temperature=0), logits.argmax(-1))


def test_samples_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next_token(logits, generator=gen) for _ in range(3000)])
    freq = torch.bincount(draws.flatten(), minlength=3) / 3000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_low_temperature_sharpens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([sample_next_token(logits, temperature=0.2, generator=gen) for _ in range(500)])
    assert (draws == 0).float().mean() > 0.85


def test_top_k_and_top_p_never_pick_the_tail():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    gen = torch.Generator().manual_seed(2)
    top_k = torch.stack([sample_next_token(logits, top_k=2, generator=gen) for _ in range(400)])
    assert set(top_k.flatten().tolist()) == {0, 1}
    top_p = torch.stack([sample_next_token(logits, top_p=0.65, generator=gen) for _ in range(400)])
    assert set(top_p.flatten().tolist()) == {0, 1}   # 0.4 + 0.3 reaches 0.65


def test_seeded_generator_reproduces_samples():
    model = model_with()
    idx = torch.zeros(1, 3, dtype=torch.long)
    a = generate(model, idx, 10, generator=torch.Generator().manual_seed(5))
    b = generate(model, idx, 10, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


@pytest.mark.parametrize("prompt_length,new_tokens", [(1, 12), pytest.param(5, 40, marks=pytest.mark.slow),
                                                      pytest.param(16, 30, marks=pytest.mark.slow)])
def test_cached_greedy_equals_uncached_greedy(prompt_length, new_tokens):
    # 40 new tokens on a context of 16 crosses the window rule several times
    model = model_with()
    idx = torch.randint(0, 11, (2, prompt_length), generator=torch.Generator().manual_seed(3))
    cached = generate(model, idx, new_tokens, temperature=0, use_cache=True)
    uncached = generate(model, idx, new_tokens, temperature=0, use_cache=False)
    assert cached.shape == (2, prompt_length + new_tokens)
    assert torch.equal(cached, uncached)


def test_generate_with_cache_reference_matches_generate():
    model = model_with()
    idx = torch.randint(0, 11, (3, 4))
    assert torch.equal(generate_with_cache(model, idx, 10), generate(model, idx, 10, temperature=0, use_cache=False))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_with_cache(model, idx, 20)


def test_long_prompt_is_cropped_not_refused():
    model = model_with(max_tokens=8)
    out = generate(model, torch.randint(0, 11, (1, 30)), 5, temperature=0)
    assert out.shape == (1, 35)


def test_stop_token_ends_generation():
    model = model_with()
    first = generate(model, torch.zeros(1, 2, dtype=torch.long), 1, temperature=0)[0, -1].item()
    out = generate(model, torch.zeros(1, 2, dtype=torch.long), 20, temperature=0, stop_token=first)
    assert out.shape == (1, 3) and out[0, -1] == first


def test_generation_restores_training_mode():
    model = model_with().train()
    generate(model, torch.zeros(1, 1, dtype=torch.long), 2)
    assert model.training


def test_generate_text_round_trip():
    tok = CharTokenizer.from_text("abc \n")
    model = model_with(vocab_size=tok.vocab_size)
    text = generate_text(model, tok, "ab", max_new_tokens=6, temperature=0)
    assert text.startswith("ab") and len(text) == 8


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -1}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_p": 1.5}, "top_p"),
])
def test_sampling_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_next_token(torch.randn(1, 4), **kwargs)


def test_generate_bad_arguments():
    model = model_with()
    with pytest.raises(TypeError, match="idx"):
        generate(model, torch.zeros(1, 3), 2)
    with pytest.raises(ValueError, match="idx"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, torch.zeros(1, 1, dtype=torch.long), -1)
    with pytest.raises(TypeError, match="prompt"):
        generate_text(model, CharTokenizer.from_text("ab"), 3)


def test_out_of_vocabulary_ids_are_named_with_vocab_size():
    # the usual mismatch: a tokenizer bigger than the model it feeds
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=5, max_tokens=8, embed_dim=16, num_heads=2, num_layers=1))
    bad = torch.tensor([[1, 2, 7]])
    for call in (lambda: model(bad), lambda: generate(model, bad, 2), lambda: generate_with_cache(model, bad, 2)):
        with pytest.raises(ValueError, match=r"idx: expected token ids in 0..4 \(vocab_size=5\), got 7; the "
                                             r"tokenizer and the model disagree"):
            call()
    with pytest.raises(ValueError, match=r"got -1"):
        model(torch.tensor([[0, -1]]))


def test_a_kv_cache_refuses_a_new_batch_size():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=5, max_tokens=8, embed_dim=16, num_heads=2, num_layers=1)).eval()
    cache = model.new_cache()
    model(torch.zeros(2, 3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"k: this cache holds a batch of 2 sequences, got a batch of 3; start "
                                         r"a new cache \(model.new_cache\(\)\)"):
        model(torch.zeros(3, 1, dtype=torch.long), cache)
