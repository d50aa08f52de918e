"""course_lib.variants.streaming: a ModernGPT read through a sliding window with sinks (notebook 12, section 2)."""
from __future__ import annotations

import pytest
import torch

from course_lib.modern_gpt import ModernGPT, ModernGPTConfig
from course_lib.variants import RingKVCache, SlidingWindowAttention
from course_lib.variants.streaming import first_position_share, streaming_logits


def _model(**options) -> ModernGPT:
    torch.manual_seed(0)
    config = ModernGPTConfig(vocab_size=11, max_tokens=16, embed_dim=16, num_heads=2, num_layers=2, **options)
    return ModernGPT(config).eval()


def _tokens(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 11, (2, length), generator=torch.Generator().manual_seed(seed))   # (N, L)


def test_a_window_as_long_as_the_input_is_the_model_itself():
    model, idx = _model(num_kv_heads=1), _tokens(16)
    with torch.no_grad():
        expected = model(idx)
    torch.testing.assert_close(streaming_logits(model, idx, window=16), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(streaming_logits(model, idx, window=100, sinks=3), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, sinks", [(3, 0), (3, 2), (5, 1)])
def test_it_is_what_generation_with_a_ring_buffer_in_every_layer_computes(window, sinks):
    """One token at a time, each layer with its own RingKVCache of sinks + window slots: the same logits."""
    model, idx = _model(), _tokens(24)      # longer than max_tokens: the ring needs no table
    layers = []
    for block in model.blocks:
        attn = SlidingWindowAttention(16, 2, window, sinks)
        attn.load_state_dict(block.attn.state_dict())
        layers.append((block, attn, RingKVCache(window, sinks)))
    steps = []
    with torch.no_grad():
        for t in range(idx.shape[1]):
            x = model.token_embedding(idx[:, t:t + 1])                     # (N, 1, embed_dim)
            for block, attn, cache in layers:
                x = x + attn(block.attn_norm(x), cache)
                x = x + block.mlp(block.mlp_norm(x))
            steps.append(model.head(model.norm_f(x)))
    torch.testing.assert_close(streaming_logits(model, idx, window, sinks), torch.cat(steps, dim=1),
                               rtol=1e-5, atol=1e-5)


def test_only_the_window_and_the_sinks_reach_a_late_token():
    """Two layers of a window of 3 reach 4 tokens back; a sink reaches from any distance."""
    model, idx = _model(), _tokens(30)
    changed = idx.clone()
    changed[:, 0] = (idx[:, 0] + 1) % 11
    late = slice(20, None)
    without = streaming_logits(model, idx, 3), streaming_logits(model, changed, 3)
    torch.testing.assert_close(without[0][:, late], without[1][:, late])
    with_sink = streaming_logits(model, idx, 3, sinks=1), streaming_logits(model, changed, 3, sinks=1)
    assert (with_sink[0][:, late] - with_sink[1][:, late]).abs().amax() > 1e-4


def test_the_model_is_left_as_it_was():
    model = _model()
    model.train()
    streaming_logits(model, _tokens(8), 4)
    assert model.training


def test_first_position_share_of_uniform_causal_weights():
    length = 6
    weights = torch.ones(length, length).tril()
    weights = (weights / weights.sum(-1, keepdim=True)).expand(2, 3, 4, length, length)   # (layers, N, H, L, L)
    expected = sum(1 / (i + 1) for i in range(1, length)) / (length - 1)
    torch.testing.assert_close(first_position_share(weights), torch.full((2,), expected))
    torch.testing.assert_close(first_position_share(weights, skip=5), torch.full((2,), 1 / 6))


@pytest.mark.parametrize("call, match", [
    (lambda: streaming_logits(torch.nn.Linear(2, 2), _tokens(4), 2), "model: expected a course_lib.ModernGPT"),
    (lambda: streaming_logits(_model(qk_norm=True), _tokens(4), 2), "model: expected a plain ModernGPT"),
    (lambda: streaming_logits(_model(), _tokens(4), 0), "window"),
    (lambda: streaming_logits(_model(), _tokens(4), 2, sinks=-1), "sinks"),
    (lambda: streaming_logits(_model(), _tokens(4) + 20, 2), "idx"),
    (lambda: first_position_share(torch.ones(2, 3, 3)), "weights"),
    (lambda: first_position_share(torch.ones(1, 1, 1, 3, 4)), "weights: expected square"),
    (lambda: first_position_share(torch.ones(1, 1, 1, 3, 3), skip=3), "skip"),
])
def test_wrong_inputs_are_named(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()
