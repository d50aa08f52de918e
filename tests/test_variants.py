"""Notebook 12's reference, part 1 (course_lib.variants.sliding): the sliding-window mask with sinks,
the ring-buffer KV cache, and the attention that streams through it."""
from __future__ import annotations

import pytest
import torch

from course_lib import variants
from course_lib.modern import GroupedQueryAttention, rope_tables
from course_lib.modern import sliding_window_mask as modern_window_mask
from course_lib.variants import RingKVCache, SlidingWindowAttention, rope_rows, sliding_window_mask


def loop_mask(length: int, window: int, sinks: int) -> torch.Tensor:
    """The convention, written as a loop: query i sees key j <= i when i - j < window or j < sinks."""
    mask = torch.zeros(length, length, dtype=torch.bool)
    for i in range(length):
        for j in range(length):
            mask[i, j] = j <= i and (i - j < window or j < sinks)
    return mask


@pytest.mark.parametrize("length, window, sinks", [(1, 1, 0), (7, 1, 0), (7, 3, 0), (9, 4, 2), (6, 10, 0),
                                                   (8, 3, 1), (5, 2, 7), (12, 5, 3)])
def test_sliding_window_mask_matches_the_loop(length, window, sinks):
    mask = sliding_window_mask(length, window, sinks)
    assert mask.dtype == torch.bool and mask.shape == (length, length)
    assert torch.equal(mask, loop_mask(length, window, sinks))


def test_a_window_counts_the_query_itself():
    mask = sliding_window_mask(10, 3)
    # w keys per query including itself: the first rows see fewer, all later ones exactly 3
    assert mask.sum(dim=1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3, 3, 3]
    assert mask[5, 5] and mask[5, 3] and not mask[5, 2] and not mask[5, 6]
    assert torch.equal(sliding_window_mask(6, 6), torch.ones(6, 6, dtype=torch.bool).tril())   # w >= L is causal
    assert torch.equal(sliding_window_mask(9, 4, sinks=0), modern_window_mask(9, 4))


def test_sinks_stay_visible_but_never_from_the_past():
    mask = sliding_window_mask(10, 2, sinks=2)
    assert mask[9, :2].all() and mask[9, 8:].all() and not mask[9, 2:8].any()
    assert not mask[0, 1]   # a sink is not visible before it exists


@pytest.mark.parametrize("bad, message", [(dict(length=0, window=2), "length"), (dict(length=4, window=0), "window"),
                                          (dict(length=4, window=2, sinks=-1), "sinks"),
                                          (dict(length=4, window=2.0), "window")])
def test_sliding_window_mask_names_a_bad_argument(bad, message):
    with pytest.raises(ValueError, match=f"^{message}: expected"):
        sliding_window_mask(**bad)


def test_rope_rows_are_rows_of_rope_tables():
    cos, sin = rope_tables(8, 40, 500.0)
    rc, rs = rope_rows(8, 13, 20, 500.0)
    assert torch.equal(rc, cos[13:33]) and torch.equal(rs, sin[13:33])
    with pytest.raises(ValueError, match="head_dim: expected an even"):
        rope_rows(7, 0, 3)


# ---------------------------------------------------------------- the ring buffer

def kv(n: int, heads: int, length: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, length, dim, generator=g), torch.randn(n, heads, length, dim + 1, generator=g)


@pytest.mark.parametrize("window, sinks, chunks", [(4, 0, [1] * 15), (4, 2, [1] * 15), (3, 1, [5, 1, 7, 2]),
                                                   (5, 3, [2, 2, 9, 1, 1])])
def test_ring_keeps_the_sinks_and_the_last_window(window, sinks, chunks):
    cache = RingKVCache(window, sinks)
    seen_k, seen_v, total = [], [], 0
    for step, size in enumerate(chunks):
        k, v = kv(2, 3, size, 4, step)
        keys, values, positions = cache.append(k, v)
        seen_k.append(k)
        seen_v.append(v)
        total += size
        all_k, all_v = torch.cat(seen_k, dim=2), torch.cat(seen_v, dim=2)
        # what comes back is exactly the keys and values of the positions it names
        assert torch.equal(keys, all_k[:, :, positions]) and torch.equal(values, all_v[:, :, positions])
        assert positions[-size:].tolist() == list(range(total - size, total))
        held = sorted(p for p in cache.positions.tolist() if p >= 0)
        expected = sorted(set(range(min(sinks, total))) | set(range(max(sinks, total - window), total)))
        assert held == expected, f"after {total} tokens"
        assert cache.length == total


def test_ring_memory_is_flat_however_long_the_stream():
    cache = RingKVCache(window=8, sinks=2)
    sizes = []
    for step in range(200):
        cache.append(*kv(1, 2, 1, 4, step))
        sizes.append(cache.nbytes())
    assert set(sizes) == {sizes[0]} and sizes[0] == (1 * 2 * 10 * 4 + 1 * 2 * 10 * 5) * 4   # keys of 4, values of 5, float32
    assert cache._k.shape[2] == cache._v.shape[2] == 10


def test_ring_refuses_another_layers_keys():
    cache = RingKVCache(4)
    cache.append(*kv(1, 2, 3, 4, 0))
    with pytest.raises(ValueError, match="k, v: this cache holds"):
        cache.append(*kv(1, 3, 1, 4, 1))
    with pytest.raises(ValueError, match="window: expected a positive int"):
        RingKVCache(0)
    with pytest.raises(TypeError, match="k: expected a torch.Tensor"):
        cache.append([1.0], torch.zeros(1))


# ---------------------------------------------------------------- the attention layer

def layer(window: int, sinks: int, dtype=torch.float64, seed: int = 0, **kw) -> SlidingWindowAttention:
    torch.manual_seed(seed)
    return SlidingWindowAttention(16, 4, window, sinks, rope_theta=1000.0, **kw).to(dtype)


def attention_by_hand(m: SlidingWindowAttention, x: torch.Tensor) -> torch.Tensor:
    """Full attention over the whole sequence with the loop's mask: RoPE at positions 0..L-1."""
    n, length, _ = x.shape
    d = m.head_dim
    cos, sin = (t.to(x.dtype) for t in rope_tables(d, length, m.rope_theta, dtype=torch.float64))

    def heads(t, count):
        return t.view(n, length, count, d).transpose(1, 2)

    def rotate(t):
        return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], dim=-1) * sin

    groups = m.num_heads // m.num_kv_heads
    q = rotate(heads(m.query(x), m.num_heads))
    k = rotate(heads(m.key(x), m.num_kv_heads)).repeat_interleave(groups, dim=1)
    v = heads(m.value(x), m.num_kv_heads).repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) / d ** 0.5
    scores = scores.masked_fill(~loop_mask(length, m.window, m.sinks), float("-inf"))
    out = scores.softmax(-1) @ v
    return m.proj(out.transpose(1, 2).reshape(n, length, -1))


@pytest.mark.parametrize("window, sinks, num_kv_heads", [(3, 0, None), (5, 2, None), (4, 1, 2), (40, 0, 1)])
def test_full_forward_is_attention_under_the_mask(window, sinks, num_kv_heads):
    m = layer(window, sinks, num_kv_heads=num_kv_heads)
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    torch.testing.assert_close(m(x), attention_by_hand(m, x), rtol=0, atol=1e-12)


def test_without_sinks_it_is_grouped_query_attention_with_a_window():
    m = layer(5, 0, dtype=torch.float32, num_kv_heads=2)
    gqa = GroupedQueryAttention(16, 4, 2, max_tokens=32, rope_theta=1000.0, sliding_window=5)
    gqa.load_state_dict(m.state_dict())
    x = torch.randn(3, 30, 16)
    torch.testing.assert_close(m(x), gqa(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("window, sinks, chunks", [(4, 0, [1] * 40), (4, 2, [1] * 40), (6, 1, [9, 1, 1, 13, 1, 2, 1]),
                                                   (3, 3, [2] * 20)])
def test_streaming_through_the_ring_equals_the_full_forward_at_every_step(window, sinks, chunks):
    m = layer(window, sinks, num_kv_heads=2)
    x = torch.randn(2, sum(chunks), 16, dtype=torch.float64)
    full = m(x)
    cache = m.new_cache()
    start, sizes = 0, set()
    for size in chunks:
        out = m(x[:, start:start + size], cache)
        torch.testing.assert_close(out, full[:, start:start + size], rtol=0, atol=1e-12,
                                   msg=lambda text, s=start: f"positions from {s}: {text}")
        start += size
        sizes.add(cache.nbytes())
    assert len(sizes) == 1 and cache.length == sum(chunks)


def test_sinks_change_what_a_late_token_sees():
    plain, sunk = layer(3, 0), layer(3, 2)
    sunk.load_state_dict(plain.state_dict())
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    a, b = plain(x), sunk(x)
    torch.testing.assert_close(a[:, :3], b[:, :3], rtol=0, atol=1e-12)   # the sinks are inside every early window
    assert (a[:, 6:] - b[:, 6:]).abs().amax() > 1e-3


def test_gradients_dtype_and_input_unchanged():
    m = layer(3, 1)
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    before = x.detach().clone()
    cache = m.new_cache()
    out = torch.cat([m(x[:, :4], cache), m(x[:, 4:], cache)], dim=1)
    assert out.dtype == torch.float64
    out.square().sum().backward()
    assert torch.equal(x.detach(), before)
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
    torch.autograd.gradcheck(lambda t: layer(3, 1)(t), torch.randn(1, 6, 16, dtype=torch.float64, requires_grad=True))


def test_the_layer_names_its_bad_arguments():
    m = layer(3, 1)
    with pytest.raises(TypeError, match="cache: expected a RingKVCache"):
        m(torch.randn(1, 2, 16, dtype=torch.float64), cache=[])
    with pytest.raises(ValueError, match="cache: expected window=3, sinks=1"):
        m(torch.randn(1, 2, 16, dtype=torch.float64), cache=RingKVCache(4, 1))
    with pytest.raises(TypeError, match="x: expected dtype torch.float64"):
        m(torch.randn(1, 2, 16))
    with pytest.raises(ValueError, match="x: expected last dimension"):
        m(torch.randn(1, 2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="num_kv_heads: must divide"):
        SlidingWindowAttention(16, 4, 3, num_kv_heads=3)
    with pytest.raises(ValueError, match="sinks: expected an int >= 0"):
        SlidingWindowAttention(16, 4, 3, -1)


def test_the_package_offers_what_the_notebook_names():
    for name in ("sliding_window_mask", "RingKVCache", "SlidingWindowAttention", "MultiHeadLatentAttention",
                 "LatentCache", "kv_cache_bytes_per_token", "linear_attention", "linear_attention_recurrent",
                 "elu_feature_map"):
        assert name in variants.__all__ and hasattr(variants, name)
