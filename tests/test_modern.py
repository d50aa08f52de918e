"""Notebook 09's parts (course_lib.modern) and the model built from them (course_lib.modern_gpt)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as llama

from course_lib.attention import KVCache, MultiHeadMaskedAttention
from course_lib.data import TokenStream
from course_lib.generate import generate, generate_with_cache
from course_lib.model import GPTConfig
from course_lib.modern import (
    GroupedQueryAttention,
    ReLUSquared,
    RMSNorm,
    SwiGLU,
    apply_rotary,
    repeat_kv,
    rope_tables,
    rotate_half,
    sliding_window_mask,
)
from course_lib.modern_gpt import ModernBlock, ModernGPT, ModernGPTConfig
from course_lib.train import TrainConfig, flops_per_token, train


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def hf_rope_tables(head_dim: int, max_tokens: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_tokens,
                         rope_parameters={"rope_type": "default", "rope_theta": theta})
    rotary = llama.LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1), torch.arange(max_tokens)[None])   # (1, max_tokens, head_dim)
    return cos[0], sin[0]


# ---------------------------------------------------------------- RoPE

def test_rope_tables_hold_each_pairs_angle_twice():
    head_dim, theta = 8, 5000.0
    cos, sin = rope_tables(head_dim, 12, theta)
    assert cos.shape == sin.shape == (12, head_dim) and cos.dtype == torch.float32
    assert torch.equal(cos[:, :4], cos[:, 4:]) and torch.equal(sin[:, :4], sin[:, 4:])   # half-split layout
    m, i = 7, 3
    angle = m * theta ** (-2 * i / head_dim)
    assert math.isclose(cos[m, i].item(), math.cos(angle), abs_tol=1e-7)
    assert math.isclose(sin[m, i + 4].item(), math.sin(angle), abs_tol=1e-7)
    assert torch.equal(rope_tables(head_dim, 12, theta, dtype=torch.float64)[0][0], torch.ones(head_dim, dtype=torch.float64))


def test_rope_tables_and_rotation_match_transformers_for_a_non_default_theta():
    head_dim, length, theta = 16, 24, 5000.0
    cos, sin = rope_tables(head_dim, length, theta)
    hf_cos, hf_sin = hf_rope_tables(head_dim, length, theta)
    assert (cos - hf_cos).abs().max() < 1e-6 and (sin - hf_sin).abs().max() < 1e-6
    assert not torch.allclose(cos, rope_tables(head_dim, length)[0], atol=1e-3)   # theta matters
    q = torch.randn(2, 3, 10, head_dim, generator=gen(0))
    k = torch.randn(2, 3, 10, head_dim, generator=gen(1))
    offset = 5   # positions 5..14, as during cached decoding
    hf_q, hf_k = llama.apply_rotary_pos_emb(q, k, hf_cos[None, offset:offset + 10], hf_sin[None, offset:offset + 10])
    assert (apply_rotary(q, cos, sin, offset) - hf_q).abs().max() < 1e-5
    assert (apply_rotary(k, cos, sin, offset) - hf_k).abs().max() < 1e-5


def test_rotate_half_matches_transformers_and_is_a_quarter_turn():
    x = torch.randn(3, 5, 8, generator=gen(2))
    assert torch.equal(rotate_half(x), llama.rotate_half(x))
    assert torch.equal(rotate_half(rotate_half(x)), -x)
    assert torch.allclose((x * rotate_half(x)).sum(-1), torch.zeros(3, 5), atol=1e-6)   # orthogonal


def test_rope_score_depends_only_on_the_offset_between_query_and_key():
    head_dim = 16
    cos, sin = rope_tables(head_dim, 40, 10000.0)
    q = torch.randn(1, 1, 1, head_dim, generator=gen(3))
    k = torch.randn(1, 1, 1, head_dim, generator=gen(4))

    def score(m: int, n: int) -> float:
        return (apply_rotary(q, cos, sin, m) * apply_rotary(k, cos, sin, n)).sum().item()

    for offset in (0, 3, 11):
        scores = [score(n + offset, n) for n in (0, 5, 17, 28)]
        assert max(scores) - min(scores) < 1e-4, (offset, scores)
    assert abs(score(3, 0) - score(11, 0)) > 1e-2   # and it does depend on the offset
    assert torch.allclose(apply_rotary(q, cos, sin, 9).norm(), q.norm())   # a rotation keeps lengths


def test_apply_rotary_offset_continues_the_positions():
    cos, sin = rope_tables(8, 20)
    x = torch.randn(2, 2, 9, 8, generator=gen(5))
    assert torch.allclose(apply_rotary(x, cos, sin)[:, :, 4:7], apply_rotary(x[:, :, 4:7], cos, sin, offset=4))


# ---------------------------------------------------------------- RMSNorm, MLPs, repeat_kv, masks

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rms_norm_matches_llama(dtype, tol):
    ours, theirs = RMSNorm(12, eps=1e-5), llama.LlamaRMSNorm(12, eps=1e-5)
    weight = 1 + 0.3 * torch.randn(12, generator=gen(6))
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    x = (3 * torch.randn(4, 7, 12, generator=gen(7))).to(dtype)
    out = ours.to(dtype)(x)
    assert out.dtype == dtype
    assert (out.float() - theirs.to(dtype)(x).float()).abs().max() < tol
    tiny = torch.full((1, 12), 1e-4)   # the epsilon is inside the square root, not left out
    assert RMSNorm(12, eps=1e-5)(tiny).abs().max() < 0.05


def test_swiglu_and_relu_squared_compute_their_formulas():
    x = torch.randn(2, 5, 8, generator=gen(8))
    swiglu = SwiGLU(8, 24)
    assert [name for name, _ in swiglu.named_parameters()] == ["gate.weight", "up.weight", "down.weight"]
    expected = (F.silu(x @ swiglu.gate.weight.T) * (x @ swiglu.up.weight.T)) @ swiglu.down.weight.T
    assert torch.allclose(swiglu(x), expected, atol=1e-6)
    relu2 = ReLUSquared(8, 32)
    assert torch.allclose(relu2(x), F.relu(x @ relu2.up.weight.T).square() @ relu2.down.weight.T, atol=1e-6)


def test_repeat_kv_matches_transformers_and_sends_each_query_head_to_its_group():
    x = torch.randn(2, 3, 5, 4, generator=gen(9))
    out = repeat_kv(x, 4)
    assert out.shape == (2, 12, 5, 4)
    assert torch.equal(out, llama.repeat_kv(x, 4))
    for head in range(12):
        assert torch.equal(out[:, head], x[:, head // 4])
    assert repeat_kv(x, 1) is x


def test_sliding_window_mask_sees_itself_and_the_window_before():
    mask = sliding_window_mask(6, 3)
    for i in range(6):
        for j in range(6):
            assert bool(mask[i, j]) == (0 <= i - j < 3)
    assert torch.equal(sliding_window_mask(5, 5), torch.ones(5, 5, dtype=torch.bool).tril())


# ---------------------------------------------------------------- grouped-query attention

def by_hand(attn: GroupedQueryAttention, x: torch.Tensor) -> torch.Tensor:
    """Each query head h against key/value head h // groups, written out one head at a time."""
    n, length, _ = x.shape
    d = attn.head_dim
    cos, sin = rope_tables(d, length, attn.rope_theta)
    q = attn.query(x).view(n, length, attn.num_heads, d).transpose(1, 2)
    k = attn.key(x).view(n, length, attn.num_kv_heads, d).transpose(1, 2)
    v = attn.value(x).view(n, length, attn.num_kv_heads, d).transpose(1, 2)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    heads = []
    for h in range(attn.num_heads):
        g = h // (attn.num_heads // attn.num_kv_heads)
        scores = (q[:, h] @ k[:, g].transpose(-1, -2) / math.sqrt(d)).masked_fill(future, float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, g])                        # (N, L, d)
    return attn.proj(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])   # MHA, GQA, MQA
def test_grouped_query_attention_equals_the_per_head_computation(num_kv_heads):
    torch.manual_seed(10)
    attn = GroupedQueryAttention(32, 4, num_kv_heads, 16, rope_theta=5000.0)
    assert attn.key.weight.shape == (num_kv_heads * 8, 32)
    x = torch.randn(2, 9, 32, generator=gen(11))
    assert (attn(x) - by_hand(attn, x)).abs().max() < 1e-5


def test_mha_endpoint_without_rotation_is_notebook_03s_attention():
    torch.manual_seed(12)
    attn = GroupedQueryAttention(32, 4, 4, 16)
    mha = MultiHeadMaskedAttention(32, 4, 16, fused=False)
    with torch.no_grad():
        for name in ("query", "key", "value", "proj"):
            getattr(mha, name).weight.copy_(getattr(attn, name).weight)
        attn.rope_cos.fill_(1.0)   # angle 0 everywhere: RoPE switched off
        attn.rope_sin.fill_(0.0)
    x = torch.randn(2, 10, 32, generator=gen(13))
    assert (attn(x) - mha(x)).abs().max() < 1e-5


class RecordingCache(KVCache):
    def __init__(self, max_tokens: int):
        super().__init__(max_tokens)
        self.shapes: list[tuple[int, ...]] = []

    def append(self, k, v):
        self.shapes.append(tuple(k.shape))
        return super().append(k, v)


@pytest.mark.parametrize("options", [{}, {"qk_norm": True}, {"sliding_window": 3},
                                     {"qk_norm": True, "sliding_window": 4}])
def test_cached_decoding_equals_the_full_pass_and_caches_kv_heads_only(options):
    torch.manual_seed(14)
    attn = GroupedQueryAttention(48, 6, 2, 20, rope_theta=500000.0, **options).eval()
    if options.get("qk_norm"):
        with torch.no_grad():
            attn.q_norm.weight.normal_(1.0, 0.3)
            attn.k_norm.weight.normal_(1.0, 0.3)
    x = torch.randn(2, 13, 48, generator=gen(15))
    cache = RecordingCache(20)
    pieces = [attn(x[:, :5], cache), attn(x[:, 5:6], cache), attn(x[:, 6:9], cache)]
    pieces += [attn(x[:, i:i + 1], cache) for i in range(9, 13)]
    assert (torch.cat(pieces, 1) - attn(x)).abs().max() < 1e-5
    assert cache.length == 13
    assert {shape[1] for shape in cache.shapes} == {2}   # num_kv_heads, not num_heads


def test_sliding_window_hides_what_lies_beyond_the_window():
    torch.manual_seed(16)
    attn = GroupedQueryAttention(16, 2, 1, 12, sliding_window=3).eval()
    x = torch.randn(1, 10, 16, generator=gen(17))
    changed = x.clone()
    changed[:, 2] += 1.0
    out, out_changed = attn(x), attn(changed)
    differs = (out - out_changed).abs().amax(-1)[0] > 1e-6   # (L,)
    assert differs.tolist() == [False, False, True, True, True] + [False] * 5   # positions 2, 3, 4 see token 2
    wide = GroupedQueryAttention(16, 2, 1, 12, sliding_window=12).eval()
    wide.load_state_dict(attn.state_dict())
    full = GroupedQueryAttention(16, 2, 1, 12).eval()
    full.load_state_dict(attn.state_dict())
    assert (wide(x) - full(x)).abs().max() < 1e-6


def test_qk_norm_normalises_queries_and_keys():
    torch.manual_seed(18)
    attn = GroupedQueryAttention(16, 2, 1, 8, qk_norm=True, norm_eps=1e-5).eval()
    assert isinstance(attn.q_norm, RMSNorm) and attn.q_norm.dim == 8 and attn.k_norm.eps == 1e-5
    x = torch.randn(1, 6, 16, generator=gen(19))
    before = attn(x)
    with torch.no_grad():
        attn.k_norm.weight.mul_(3.0)   # sharper scores: a different output
    assert (attn(x) - before).abs().max() > 1e-3
    assert GroupedQueryAttention(16, 2, 1, 8).q_norm is None


def test_attention_runs_in_float64_and_bfloat16():
    torch.manual_seed(20)
    attn = GroupedQueryAttention(32, 4, 2, 16, qk_norm=True).eval()
    x = torch.randn(2, 9, 32, generator=gen(21))
    reference = attn(x)
    attn64 = attn.double()
    cache = attn64.new_cache()
    cached = torch.cat([attn64(x.double()[:, :4], cache), attn64(x.double()[:, 4:], cache)], 1)
    assert cached.dtype == torch.float64
    assert (cached - attn64(x.double())).abs().max() < 1e-12
    assert (attn64(x.double()) - reference).abs().max() < 1e-5
    out16 = attn.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out16.dtype == torch.bfloat16
    assert (out16.float() - reference).abs().max() < 5e-2


@pytest.mark.parametrize("build,match", [
    (lambda: GroupedQueryAttention(32, 4, 3, 16), "num_kv_heads: must divide num_heads=4"),
    (lambda: GroupedQueryAttention(12, 4, 2, 16), "head_dim: expected an even number"),
    (lambda: GroupedQueryAttention(30, 4, 2, 16), "num_heads: embed_dim=30 must be divisible"),
    (lambda: GroupedQueryAttention(32, 4, 0, 16), "num_kv_heads: expected a positive int"),
    (lambda: GroupedQueryAttention(32, 4, 2, 16, sliding_window=0), "sliding_window"),
    (lambda: rope_tables(8, 16, theta=-1.0), "theta: expected a number > 0"),
    (lambda: RMSNorm(8, eps=0), "eps"),
    (lambda: repeat_kv(torch.zeros(1, 2, 3, 4), 0), "groups"),
    (lambda: repeat_kv(torch.zeros(2, 3, 4), 2), "x: expected a tensor with 4 dimension"),
    (lambda: apply_rotary(torch.zeros(1, 1, 4, 8), *rope_tables(8, 6), offset=3), "offset: positions 3..6"),
    (lambda: apply_rotary(torch.zeros(1, 1, 4, 8), *rope_tables(4, 6)), "cos, sin: expected two"),
    (lambda: RMSNorm(8)(torch.zeros(2, 6)), "x: expected a last dimension of 8"),
    (lambda: GroupedQueryAttention(32, 4, 2, 16)(torch.zeros(1, 17, 32)), "max_tokens=16"),
    (lambda: GroupedQueryAttention(32, 4, 2, 16)(torch.zeros(1, 5, 24)), "x: expected last dimension"),
])
def test_parts_refuse_bad_arguments_by_name(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


# ---------------------------------------------------------------- ModernGPT

def small(**overrides) -> ModernGPTConfig:
    values = dict(vocab_size=13, max_tokens=16, embed_dim=32, num_heads=4, num_kv_heads=2, num_layers=2)
    values.update(overrides)
    return ModernGPTConfig(**values)


def test_config_fills_in_its_defaults():
    c = ModernGPTConfig(vocab_size=10, embed_dim=48, num_heads=6)
    assert (c.num_kv_heads, c.head_dim, c.groups) == (6, 8, 1)
    assert c.hidden_dim == 128 and c.hidden_dim % 8 == 0 and c.hidden_dim >= 8 * 48 / 3   # SwiGLU: 8/3 up to x8
    assert ModernGPTConfig(vocab_size=10, embed_dim=48, num_heads=6, mlp="relu2").hidden_dim == 192
    assert small(num_heads=2, head_dim=24).head_dim == 24   # explicit: query width 48, not embed_dim


def test_config_round_trip_and_unknown_fields():
    c = small(qk_norm=True, sliding_window=5, tie_weights=True, rope_theta=500000.0, mlp="relu2")
    assert ModernGPTConfig.from_dict(c.to_dict()) == c
    assert small() == small(num_kv_heads=2, hidden_dim=88, head_dim=8)   # defaults are filled in
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['n_kv_heads'\]"):
        ModernGPTConfig.from_dict({**c.to_dict(), "n_kv_heads": 1})


@pytest.mark.parametrize("overrides,match", [
    ({"num_kv_heads": 3}, r"ModernGPTConfig.num_kv_heads: must divide num_heads=4 .* choose from \[1, 2, 4\]"),
    ({"num_kv_heads": 0}, "ModernGPTConfig.num_kv_heads: expected a positive int"),
    ({"embed_dim": 30}, "ModernGPTConfig.embed_dim=30 is not divisible by num_heads=4"),
    ({"embed_dim": 12}, r"ModernGPTConfig.head_dim: expected an even number .* got 3"),
    ({"head_dim": 7}, "ModernGPTConfig.head_dim: expected an even number"),
    ({"mlp": "geglu"}, "ModernGPTConfig.mlp: expected one of"),
    ({"hidden_dim": 0}, "ModernGPTConfig.hidden_dim"),
    ({"rope_theta": 0}, "ModernGPTConfig.rope_theta: expected a number > 0"),
    ({"norm_eps": -1e-6}, "ModernGPTConfig.norm_eps"),
    ({"qk_norm": 1}, "ModernGPTConfig.qk_norm: expected True or False"),
    ({"tie_weights": "yes"}, "ModernGPTConfig.tie_weights"),
    ({"sliding_window": 0}, "ModernGPTConfig.sliding_window"),
    ({"dropout_rate": 1.0}, "ModernGPTConfig.dropout_rate"),
    ({"vocab_size": 0}, "ModernGPTConfig.vocab_size"),
    ({"num_layers": 2.0}, "ModernGPTConfig.num_layers"),
    ({"max_tokens": -1}, "ModernGPTConfig.max_tokens"),
])
def test_config_validates_every_field_by_name(overrides, match):
    with pytest.raises((ValueError, TypeError), match=match):
        small(**overrides)


def test_model_shapes_parts_and_parameter_count():
    c = small()
    model = ModernGPT(c)
    logits = model(torch.randint(0, 13, (3, 11)))
    assert logits.shape == (3, 11, 13)
    block = model.blocks[0]
    assert isinstance(block, ModernBlock) and isinstance(block.attn, GroupedQueryAttention)
    assert isinstance(block.attn_norm, RMSNorm) and isinstance(block.mlp, SwiGLU) and isinstance(model.norm_f, RMSNorm)
    e, v, h, kv = c.embed_dim, c.vocab_size, c.hidden_dim, c.num_kv_heads * c.head_dim
    per_block = 2 * e + (e * e + 2 * e * kv + e * e) + 3 * e * h
    expected = v * e + c.num_layers * per_block + e + e * v
    assert model.num_parameters() == model.num_parameters(include_embeddings=False) == expected
    tied = ModernGPT(small(tie_weights=True))
    assert tied.head.weight is tied.token_embedding.weight and tied.num_parameters() == expected - v * e
    assert isinstance(ModernGPT(small(mlp="relu2")).blocks[1].mlp, ReLUSquared)


def test_block_normalises_before_each_branch_and_adds_it_back():
    torch.manual_seed(31)
    block = ModernBlock(small(norm_eps=1e-5)).eval()
    with torch.no_grad():
        block.attn_norm.weight.normal_(1.0, 0.5)
        block.mlp_norm.weight.normal_(1.0, 0.5)
    x = 3 * torch.randn(2, 6, 32, generator=gen(32))
    mid = x + block.attn(block.attn_norm(x))
    assert (block(x) - (mid + block.mlp(block.mlp_norm(mid)))).abs().max() < 1e-5
    assert block.attn_norm.eps == block.mlp_norm.eps == 1e-5


def test_residual_projections_start_smaller():
    model = ModernGPT(small(embed_dim=64, num_layers=8))
    block = model.blocks[3]
    assert 0.015 < block.attn.query.weight.std() < 0.025
    for proj in (block.attn.proj, block.mlp.down):
        assert proj.weight.std() < 0.01   # 0.02 / sqrt(2 * 8)


@pytest.mark.parametrize("overrides", [{}, {"qk_norm": True, "sliding_window": 4, "mlp": "relu2", "tie_weights": True}])
def test_model_is_causal_and_its_cache_equals_the_full_pass(overrides):
    torch.manual_seed(22)
    model = ModernGPT(small(**overrides)).eval()
    idx = torch.randint(0, 13, (2, 12), generator=gen(23))
    full = model(idx)
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 13
    after = model(changed)
    assert torch.equal(full[:, :7], after[:, :7])
    assert (full[:, 7] - after[:, 7]).abs().max() > 1e-4
    cache = model.new_cache()
    pieces = [model(idx[:, :5], cache)] + [model(idx[:, i:i + 1], cache) for i in range(5, 12)]
    assert (torch.cat(pieces, 1) - full).abs().max() < 1e-5


def test_model_in_float64_and_bfloat16():
    torch.manual_seed(24)
    model = ModernGPT(small()).eval()
    idx = torch.randint(0, 13, (2, 9), generator=gen(25))
    reference = model(idx)
    assert model.double()(idx).dtype == torch.float64
    assert (model(idx) - reference).abs().max() < 1e-5
    out16 = model.to(torch.bfloat16)(idx)
    assert out16.dtype == torch.bfloat16 and (out16.float() - reference).abs().max() < 0.1


def test_generate_with_the_cache_matches_uncached_greedy():
    torch.manual_seed(26)
    model = ModernGPT(small()).eval()
    prompt = torch.randint(0, 13, (2, 3), generator=gen(27))
    cached = generate(model, prompt, 30, temperature=0)        # past max_tokens=16: the window moves
    assert cached.shape == (2, 33)
    assert torch.equal(cached, generate(model, prompt, 30, temperature=0, use_cache=False))
    assert torch.equal(generate_with_cache(model, prompt, 10), cached[:, :13])
    sampled = generate(model, prompt, 8, temperature=1.0, top_k=5, generator=gen(28))
    assert sampled.shape == (2, 11) and int(sampled.max()) < 13


def test_training_loop_trains_a_modern_gpt():
    torch.manual_seed(29)
    ids = torch.arange(600) % 7   # a pattern a tiny model learns in a few steps
    model = ModernGPT(small(vocab_size=7, num_layers=1))
    config = TrainConfig(steps=12, batch_size=8, learning_rate=3e-3, warmup_steps=1, eval_interval=12,
                         eval_windows=4, log_interval=4)
    history = train(model, TokenStream(ids[:500]), TokenStream(ids[500:]), config, device="cpu", progress=False)
    assert history.steps_taken == 12 and history.val_step == [12]
    assert history.train_loss[-1] < history.train_loss[0] - 0.3


def test_dropout_in_train_mode_only():
    model = ModernGPT(small(dropout_rate=0.3))
    idx = torch.randint(0, 13, (2, 10), generator=gen(30))
    assert not torch.allclose(model.train()(idx), model(idx))
    assert torch.equal(model.eval()(idx), model(idx))


def test_flops_per_token_reads_a_modern_config():
    c = small()
    n = ModernGPT(c).num_parameters()
    assert flops_per_token(c, n) == 6 * n + 12 * 2 * 4 * 8 * 16
    assert flops_per_token(small(sliding_window=4), n) == 6 * n + 12 * 2 * 4 * 8 * 4
    assert flops_per_token(GPTConfig(vocab_size=13, max_tokens=16, embed_dim=32), n) == 6 * n + 12 * 4 * 4 * 8 * 16


class PlainAttention(GroupedQueryAttention):
    """A student's class: the plain signature, no QK-norm, window or dropout options."""

    def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0):
        super().__init__(embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta)


def test_parts_come_from_the_classes_given():
    model = ModernGPT(small(norm_eps=1e-5, rope_theta=500000.0), attention_cls=PlainAttention)
    assert all(type(block.attn) is PlainAttention for block in model.blocks)
    assert model.blocks[0].attn.rope_theta == 500000.0 and model.norm_f.eps == 1e-5
    with pytest.raises(TypeError, match=r"attention_cls: PlainAttention does not take qk_norm.*qk_norm=True"):
        ModernGPT(small(qk_norm=True), attention_cls=PlainAttention)
    with pytest.raises(TypeError, match="mlp_cls: expected a class"):
        ModernGPT(small(), mlp_cls="swiglu")
    with pytest.raises(TypeError, match="norm_cls: .* should build an nn.Module"):
        ModernGPT(small(), norm_cls=lambda dim, eps: None)


def test_model_input_errors():
    model = ModernGPT(small())
    with pytest.raises(ValueError, match="longer than max_tokens=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    cache = model.new_cache()
    model(torch.zeros(1, 10, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="idx: sequence of 17 tokens"):
        model(torch.zeros(1, 7, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="cache: expected 2 KVCache"):
        model(torch.zeros(1, 3, dtype=torch.long), cache[:1])
    with pytest.raises(TypeError, match="idx: expected integer token ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"idx: expected token ids in 0..12"):
        model(torch.full((1, 4), 13))
    with pytest.raises(TypeError, match="config: expected a ModernGPTConfig"):
        ModernGPT(GPTConfig(vocab_size=13))
