"""Notebook 12's reference, part 2 (course_lib.variants.latent and cache_size): multi-head latent attention
checked against a randomly initialised tiny Hugging Face DeepSeek-V3 (nothing downloaded), its latent cache,
its absorbed form, and the cache bytes per token of MHA, GQA, MQA and MLA against real cache tensors."""
from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3Model

from course_lib.attention import KVCache, MultiHeadMaskedAttention
from course_lib.modern import GroupedQueryAttention
from course_lib.variants import LatentCache, MultiHeadLatentAttention, kv_cache_bytes_per_token

SIZES = dict(kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=10)


def deepseek_config(q_lora_rank: int | None, rope_interleave: bool, layers: int = 2) -> DeepseekV3Config:
    # every layer dense (first_k_dense_replace >= layers): the experts never run, attention is all we compare
    return DeepseekV3Config(vocab_size=50, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                            first_k_dense_replace=layers, q_lora_rank=q_lora_rank, max_position_embeddings=64,
                            rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                            rope_interleave=rope_interleave, attn_implementation="eager", **SIZES)


def ours_for(config: DeepseekV3Config, **kw) -> MultiHeadLatentAttention:
    return MultiHeadLatentAttention(config.hidden_size, config.num_attention_heads, 64, q_lora_rank=config.q_lora_rank,
                                    rope_theta=500.0, rope_interleave=config.rope_interleave, **SIZES, **kw)


def randomise(module: torch.nn.Module, seed: int) -> None:
    """Weights of unit-scale outputs (not 0.02-std ones, under which a 1e-5 tolerance would prove nothing);
    norm weights away from 1, so a forgotten norm weight shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


class Recorder:
    """The input and output of a DeepSeek attention layer, at every call."""

    def __init__(self, attention: torch.nn.Module):
        self.inputs, self.outputs = [], []
        attention.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, output):
        self.inputs.append(kwargs["hidden_states"].detach().clone())
        self.outputs.append(output[0].detach().clone())


def deepseek(q_lora_rank, rope_interleave, seed=0):
    torch.manual_seed(seed)
    model = DeepseekV3Model(deepseek_config(q_lora_rank, rope_interleave)).eval()
    for i, block in enumerate(model.layers):
        randomise(block.self_attn, seed + i)
    return model


CASES = [(None, True), (16, True), (16, False), (None, False)]


@pytest.mark.parametrize("q_lora_rank, rope_interleave", CASES)
def test_mla_matches_deepseek_v3_loading_theirs_into_ours(q_lora_rank, rope_interleave):
    model = deepseek(q_lora_rank, rope_interleave)
    attention = model.layers[1].self_attn   # the second layer: its input is not a plain embedding
    seen = Recorder(attention)
    ids = torch.randint(0, 50, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
        ours = ours_for(model.config)
        ours.load_state_dict(attention.state_dict(), strict=True)
        for absorb in (False, True):
            out = ours(seen.inputs[0], absorb=absorb)
            assert seen.outputs[0].std() > 0.1   # outputs of unit scale, so 1e-5 is a real tolerance
            torch.testing.assert_close(out, seen.outputs[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank, rope_interleave", CASES[1:3])
def test_mla_matches_deepseek_v3_loading_ours_into_theirs(q_lora_rank, rope_interleave):
    model = deepseek(q_lora_rank, rope_interleave)
    attention = model.layers[0].self_attn
    ours = ours_for(model.config)
    randomise(ours, seed=7)
    attention.load_state_dict(ours.state_dict(), strict=True)
    seen = Recorder(attention)
    with torch.no_grad():
        model(torch.randint(0, 50, (3, 13), generator=torch.Generator().manual_seed(2)))
        torch.testing.assert_close(ours(seen.inputs[0]), seen.outputs[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank, rope_interleave", CASES[:3])
def test_latent_cache_matches_deepseek_v3_decoding_token_by_token(q_lora_rank, rope_interleave):
    model = deepseek(q_lora_rank, rope_interleave, seed=3)
    attention = model.layers[1].self_attn
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(4))
    ours = ours_for(model.config)
    ours.load_state_dict(attention.state_dict(), strict=True)
    with torch.no_grad():
        whole = Recorder(attention)
        model(ids)
        full = whole.outputs[0]   # (the recorder goes on recording the calls below)
        seen = Recorder(attention)
        past = model(ids[:, :5], use_cache=True).past_key_values       # a prompt of 5, then one token a step
        for t in range(5, ids.shape[1]):
            past = model(ids[:, t:t + 1], past_key_values=past, use_cache=True).past_key_values
        plain, absorbed = ours.new_cache(), ours.new_cache()
        start = 0
        for x, expected in zip(seen.inputs, seen.outputs):
            size = x.shape[1]
            torch.testing.assert_close(ours(x, plain), expected, rtol=0, atol=1e-5)
            torch.testing.assert_close(ours(x, absorbed, absorb=True), expected, rtol=0, atol=1e-5)
            # and incremental decoding gives what the full forward gave on those positions
            torch.testing.assert_close(expected, full[:, start:start + size], rtol=0, atol=1e-5)
            start += size
        # the cache holds what DeepSeek's holds: the normalised latent and the rotated shared key, nothing per head
        layer = past.layers[1]
        torch.testing.assert_close(plain.latent, layer.keys[:, 0], rtol=0, atol=1e-5)
        torch.testing.assert_close(plain.k_rope, layer.values[:, 0], rtol=0, atol=1e-5)
        assert plain.latent.shape == (2, 16, SIZES["kv_lora_rank"])
        assert plain.k_rope.shape == (2, 16, SIZES["qk_rope_head_dim"])


def mla(q_lora_rank=None, dtype=torch.float64, seed=0, **kw) -> MultiHeadLatentAttention:
    torch.manual_seed(seed)
    m = MultiHeadLatentAttention(24, 3, 40, q_lora_rank=q_lora_rank, **SIZES, **kw).to(dtype)
    randomise(m, seed)
    return m


@pytest.mark.parametrize("q_lora_rank", [None, 10])
def test_absorbed_form_and_chunked_cache_give_the_full_forward(q_lora_rank):
    m = mla(q_lora_rank, bias=True)
    x = torch.randn(2, 21, 24, dtype=torch.float64)
    full = m(x)
    torch.testing.assert_close(m(x, absorb=True), full, rtol=0, atol=1e-12)
    for absorb in (False, True):
        cache, start = m.new_cache(), 0
        for size in (4, 1, 1, 7, 1, 2, 5):
            torch.testing.assert_close(m(x[:, start:start + size], cache, absorb=absorb), full[:, start:start + size],
                                       rtol=0, atol=1e-12)
            start += size
        assert cache.length == 21


def test_mla_is_causal():
    m = mla(softmax_scale=0.3)
    x = torch.randn(1, 6, 24, dtype=torch.float64)
    torch.testing.assert_close(m(x)[:, :3], m(x[:, :3]), rtol=0, atol=1e-12)
    y = x.clone()
    y[:, 3:] = torch.randn(1, 3, 24, dtype=torch.float64)
    assert (m(x)[:, 3:] - m(y)[:, 3:]).abs().amax() > 1e-3   # later tokens do change later outputs


def test_gradients_dtype_and_input_unchanged():
    m = mla(10)
    x = torch.randn(2, 7, 24, dtype=torch.float64, requires_grad=True)
    before = x.detach().clone()
    for absorb in (False, True):
        m.zero_grad()
        out = m(x, absorb=absorb)
        assert out.dtype == torch.float64
        out.square().sum().backward()
        assert torch.equal(x.detach(), before)
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
    small = mla(None)
    torch.autograd.gradcheck(lambda t: small(t, absorb=True), torch.randn(1, 4, 24, dtype=torch.float64,
                                                                           requires_grad=True))


def test_bad_arguments_are_named():
    m = mla()
    with pytest.raises(TypeError, match="cache: expected a LatentCache"):
        m(torch.randn(1, 2, 24, dtype=torch.float64), cache=KVCache(40))
    with pytest.raises(ValueError, match="qk_rope_head_dim: expected an even"):
        MultiHeadLatentAttention(24, 3, 40, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=5, v_head_dim=4)
    with pytest.raises(ValueError, match="q_lora_rank: expected None or a positive int"):
        MultiHeadLatentAttention(24, 3, 40, q_lora_rank=0, **SIZES)
    with pytest.raises(ValueError, match="x: sequence of 41 tokens"):
        m(torch.randn(1, 41, 24, dtype=torch.float64))
    with pytest.raises(TypeError, match="absorb: expected True or False"):
        m(torch.randn(1, 2, 24, dtype=torch.float64), absorb=1)
    cache = m.new_cache()
    m(torch.randn(2, 2, 24, dtype=torch.float64), cache)
    with pytest.raises(ValueError, match="latent, k_rope: this cache holds batch 2"):
        m(torch.randn(1, 1, 24, dtype=torch.float64), cache)


# ---------------------------------------------------------------- cache bytes per token

def spy(cache):
    """Record what each append returns: the cache tensors the layer reads."""
    returned, append = [], cache.append

    def recording(*args):
        out = append(*args)
        returned.append(out)
        return out
    cache.append = recording
    return returned


def bytes_per_token(tensors, batch: int) -> float:
    tensors = tensors[:2]
    length = tensors[0].shape[-2]
    return sum(t.numel() * t.element_size() for t in tensors) / (batch * length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_per_token_are_the_sizes_of_real_caches(dtype):
    x = torch.randn(3, 9, 32).to(dtype)
    mha = MultiHeadMaskedAttention(32, 4, 16).to(dtype)
    cache = KVCache(16)
    seen = spy(cache)
    mha(x, cache)
    assert bytes_per_token(seen[-1], 3) == kv_cache_bytes_per_token("mha", num_heads=4, head_dim=8, dtype=dtype)
    for kv_heads, kind in ((2, "gqa"), (1, "mqa")):
        layer = GroupedQueryAttention(32, 4, kv_heads, 16).to(dtype)
        cache = layer.new_cache()
        seen = spy(cache)
        layer(x, cache)
        sizes = dict(num_heads=4, head_dim=8) | ({"num_kv_heads": kv_heads} if kind == "gqa" else {})
        assert bytes_per_token(seen[-1], 3) == kv_cache_bytes_per_token(kind, dtype=dtype, **sizes)
    m = MultiHeadLatentAttention(32, 4, 16, **SIZES).to(dtype)
    cache = m.new_cache()
    m(x, cache)
    assert bytes_per_token([cache.latent, cache.k_rope], 3) == kv_cache_bytes_per_token(
        "mla", kv_lora_rank=12, qk_rope_head_dim=8, dtype=dtype)


def test_cache_bytes_per_token_match_deepseek_v3s_own_cache():
    model = deepseek(16, True)
    with torch.no_grad():
        past = model(torch.randint(0, 50, (2, 11)), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in past.layers for t in (layer.keys, layer.values))
    assert held / (2 * 11) == kv_cache_bytes_per_token("mla", num_layers=2, kv_lora_rank=12, qk_rope_head_dim=8)


def test_cache_bytes_per_token_by_hand():
    # a Llama-3-8B-like layer stack in bfloat16: 32 layers, 32 heads of 128, 8 key/value heads
    llama = dict(num_layers=32, num_heads=32, head_dim=128, dtype=torch.bfloat16)
    assert kv_cache_bytes_per_token("mha", **llama) == 2 * 32 * 32 * 128 * 2
    assert kv_cache_bytes_per_token("gqa", num_kv_heads=8, **llama) == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_cache_bytes_per_token("mqa", **llama) == 2 * 32 * 128 * 2
    # DeepSeek-V3: 61 layers, latent 512 plus a shared rotary key of 64
    assert kv_cache_bytes_per_token("mla", num_layers=61, kv_lora_rank=512, qk_rope_head_dim=64,
                                    dtype=torch.bfloat16) == 61 * 576 * 2


@pytest.mark.parametrize("args, error, message", [
    (dict(attention="mhq"), ValueError, "attention: expected one of"),
    (dict(attention="mha", head_dim=8), ValueError, "num_heads: expected a positive int for attention='mha'"),
    (dict(attention="mqa", head_dim=8, num_kv_heads=2), ValueError, "num_kv_heads: not used by attention='mqa'"),
    (dict(attention="gqa", num_heads=4, num_kv_heads=3, head_dim=8), ValueError, "num_kv_heads: must divide"),
    (dict(attention="mla", kv_lora_rank=0, qk_rope_head_dim=8), ValueError, "kv_lora_rank: expected a positive int"),
    (dict(attention="mha", num_heads=2, head_dim=8, dtype="float32"), TypeError, "dtype: expected a torch.dtype"),
])
def test_cache_bytes_per_token_names_a_bad_argument(args, error, message):
    with pytest.raises(error, match=message):
        kv_cache_bytes_per_token(args.pop("attention"), **args)


def test_latent_cache_alone():
    cache = LatentCache(5)
    assert cache.latent is None and cache.k_rope is None
    latent, k_rope = cache.append(torch.randn(1, 3, 4), torch.randn(1, 3, 2))
    assert latent.shape == (1, 3, 4) and k_rope.shape == (1, 3, 2)
    with pytest.raises(ValueError, match="cache: holds 3 tokens, adding 3 would exceed max_tokens=5"):
        cache.append(torch.randn(1, 3, 4), torch.randn(1, 3, 2))
    with pytest.raises(ValueError, match="k_rope: expected shape"):
        cache.append(torch.randn(1, 1, 4), torch.randn(1, 2, 2))
