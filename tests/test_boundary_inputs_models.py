"""Wrong inputs to the model parts, notebook 09-12's modules and the set-up helpers fail at the boundary with a
message naming the argument and what was given, never with torch's own error from deep inside, nor silently."""
from __future__ import annotations

import math

import pytest
import torch

from course_lib import flash_measure, heads, hosted_setup
from course_lib.attention import MultiHeadMaskedAttention
from course_lib.flash import online_softmax
from course_lib.model import (
    GPT,
    FeedForward,
    GPTConfig,
    LearnedPositionalEncoding,
    SinusoidalPositionalEncoding,
    TransformerBlock,
)
from course_lib.modern import (
    GroupedQueryAttention,
    ReLUSquared,
    RMSNorm,
    SwiGLU,
    apply_rotary,
    rope_tables,
    rotate_half,
)
from course_lib.modern_gpt import ModernGPT, ModernGPTConfig
from course_lib.variants import (
    MultiHeadLatentAttention,
    RingKVCache,
    SlidingWindowAttention,
    linear_attention,
    rope_rows,
    window_mask_at,
)

INF = math.inf


def _gpt():
    return GPT(GPTConfig(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1))


def _modern_config(**changes):
    return ModernGPTConfig(**{**dict(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1), **changes})


def _mla(**changes):
    return MultiHeadLatentAttention(**{**dict(embed_dim=8, num_heads=2, max_tokens=8, kv_lora_rank=4,
                                              qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2), **changes})


def _attention_only():
    return heads.AttentionOnly(heads.InductionConfig(vocab_size=8, half=4, embed_dim=8, min_period=2))


def _tokens(length=6):
    return torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3][:length]] * 2)


def _rotary(x):
    cos, sin = rope_tables(4, 8)
    return apply_rotary(x, cos, sin)


def _forward(**changes):
    pytest.importorskip("transformers")   # a skip, which pytest.raises lets through
    from course_lib.hf.attention_interface import course_attention_forward
    qkv = {"query": torch.randn(1, 2, 3, 4), "key": torch.randn(1, 2, 3, 4), "value": torch.randn(1, 2, 3, 4),
           **changes}
    return course_attention_forward(None, qkv["query"], qkv["key"], qkv["value"], None)


CASES = [
    # model: positions, last dimensions, sizes before nn.LayerNorm, booleans, eps
    ("learned(x)", lambda: LearnedPositionalEncoding(8, 4)(torch.zeros(1, 3, 4)), ValueError,
     ["length", "tensor of shape (1, 3, 4)", "x.shape[1]"]),
    ("sinusoidal(2.0)", lambda: SinusoidalPositionalEncoding(8, 4)(2.0), ValueError, ["length", "2.0"]),
    ("learned(-1)", lambda: LearnedPositionalEncoding(8, 4)(-1), ValueError, ["length", "-1"]),
    ("learned(start=-2)", lambda: LearnedPositionalEncoding(8, 4)(2, start=-2), ValueError, ["start", "-2"]),
    ("sinusoidal(-1)", lambda: SinusoidalPositionalEncoding(8, 4)(-1), ValueError, ["length", "-1"]),
    ("sinusoidal(start=-2)", lambda: SinusoidalPositionalEncoding(8, 4)(2, start=-2), ValueError, ["start", "-2"]),
    ("FeedForward last dim", lambda: FeedForward(8)(torch.randn(1, 2, 4)), ValueError,
     ["x", "embed_dim=8", "(1, 2, 4)"]),
    ("TransformerBlock last dim", lambda: TransformerBlock(8, 2, 8)(torch.randn(1, 2, 6)), ValueError,
     ["x", "embed_dim=8", "(1, 2, 6)"]),
    ("TransformerBlock embed_dim=-4", lambda: TransformerBlock(-4, 2, 8), ValueError, ["embed_dim", "-4"]),
    ("TransformerBlock embed_dim=8.0", lambda: TransformerBlock(8.0, 2, 8), ValueError, ["embed_dim", "8.0"]),
    ("TransformerBlock norm_first='post'", lambda: TransformerBlock(8, 2, 8, norm_first="post"), TypeError,
     ["norm_first", "'post'"]),
    ("FeedForward bias='no'", lambda: FeedForward(8, bias="no"), TypeError, ["bias", "'no'"]),
    ("GPT.num_parameters('no')", lambda: _gpt().num_parameters("no"), TypeError, ["include_embeddings", "'no'"]),
    ("GPTConfig layer_norm_eps=inf", lambda: GPTConfig(vocab_size=5, layer_norm_eps=INF), ValueError,
     ["GPTConfig.layer_norm_eps", "inf"]),
    ("TransformerBlock layer_norm_eps=inf", lambda: TransformerBlock(8, 2, 8, layer_norm_eps=INF), ValueError,
     ["layer_norm_eps", "inf"]),
    # modern: RoPE tables, integer inputs, the constructor's own argument names, finite bases
    ("rope_tables dtype='float16'", lambda: rope_tables(8, 8, dtype="float16"), TypeError, ["dtype", "'float16'"]),
    ("rope_tables device='gpu'", lambda: rope_tables(8, 8, device="gpu"), ValueError, ["device", "'gpu'"]),
    ("rope_tables dtype=long", lambda: rope_tables(8, 8, dtype=torch.long), TypeError, ["dtype", "torch.int64"]),
    ("apply_rotary long x", lambda: _rotary(torch.ones(1, 1, 2, 4, dtype=torch.long)), TypeError,
     ["x", "torch.int64"]),
    ("RMSNorm long x", lambda: RMSNorm(4)(torch.ones(2, 4, dtype=torch.long)), TypeError, ["x", "torch.int64"]),
    ("rotate_half odd", lambda: rotate_half(torch.randn(2, 5)), ValueError, ["x", "even", "(2, 5)"]),
    ("GQA rope_theta=-1", lambda: GroupedQueryAttention(8, 2, 1, 8, rope_theta=-1), ValueError,
     ["rope_theta:", "-1"]),
    ("GQA norm_eps=-1", lambda: GroupedQueryAttention(8, 2, 1, 8, qk_norm=True, norm_eps=-1), ValueError,
     ["norm_eps:", "-1"]),
    ("MLA norm_eps=-1", lambda: _mla(norm_eps=-1), ValueError, ["norm_eps:", "-1"]),
    ("GQA rope_theta=None", lambda: GroupedQueryAttention(8, 2, 1, 8, rope_theta=None), ValueError,
     ["rope_theta", "None"]),
    ("GQA rope_theta='1e4'", lambda: GroupedQueryAttention(8, 2, 1, 8, rope_theta="1e4"), ValueError,
     ["rope_theta", "'1e4'"]),
    ("GQA norm_eps='x'", lambda: GroupedQueryAttention(8, 2, 1, 8, norm_eps="x"), ValueError, ["norm_eps", "'x'"]),
    ("rope_tables theta=inf", lambda: rope_tables(8, 8, theta=INF), ValueError, ["theta", "inf"]),
    ("GQA rope_theta=inf", lambda: GroupedQueryAttention(8, 2, 1, 8, rope_theta=INF), ValueError,
     ["rope_theta", "inf"]),
    ("ModernGPTConfig rope_theta=inf", lambda: _modern_config(rope_theta=INF), ValueError,
     ["ModernGPTConfig.rope_theta", "inf"]),
    ("ModernGPTConfig norm_eps=inf", lambda: _modern_config(norm_eps=INF), ValueError,
     ["ModernGPTConfig.norm_eps", "inf"]),
    ("RMSNorm eps=inf", lambda: RMSNorm(4, eps=INF), ValueError, ["eps", "inf"]),
    ("SwiGLU last dim", lambda: SwiGLU(8, 16)(torch.randn(1, 2, 4)), ValueError, ["x", "embed_dim=8", "(1, 2, 4)"]),
    ("ReLUSquared last dim", lambda: ReLUSquared(8, 16)(torch.randn(1, 2, 4)), ValueError,
     ["x", "embed_dim=8", "(1, 2, 4)"]),
    ("ModernGPT attention_cls=MHA", lambda: ModernGPT(_modern_config(), attention_cls=MultiHeadMaskedAttention),
     TypeError, ["attention_cls", "MultiHeadMaskedAttention", "num_kv_heads, max_tokens, rope_theta"]),
    ("ModernGPT mlp_cls=SwiGLU(8, 16)", lambda: ModernGPT(_modern_config(), mlp_cls=SwiGLU(8, 16)), TypeError,
     ["mlp_cls", "instance of SwiGLU"]),
    # heads
    ("half_losses half=0", lambda: heads.half_losses(_attention_only(), _tokens(), 0), ValueError, ["half", "0"]),
    ("half_losses half=-3", lambda: heads.half_losses(_attention_only(), _tokens(), -3), ValueError, ["half", "-3"]),
    ("half_losses half=100", lambda: heads.half_losses(_attention_only(), _tokens(), 100), ValueError,
     ["half", "100"]),
    ("half_losses half=2.5", lambda: heads.half_losses(_attention_only(), _tokens(), 2.5), ValueError,
     ["half", "2.5"]),
    ("half_losses model='model'", lambda: heads.half_losses("model", _tokens(), 2), TypeError, ["model", "'model'"]),
    ("half_losses tokens (2, 1)", lambda: heads.half_losses(_attention_only(), _tokens(1), 2), ValueError,
     ["tokens", "(2, 1)"]),
    ("repeated_tokens generator=0", lambda: heads.repeated_tokens(2, 4, 10, generator=0), TypeError,
     ["generator", "0 (int)"]),
    ("InductionConfig min_period=4.5", lambda: heads.InductionConfig(min_period=4.5), ValueError,
     ["min_period", "4.5"]),
    ("InductionConfig min_period=None", lambda: heads.InductionConfig(min_period=None), ValueError,
     ["min_period", "None"]),
    ("InductionConfig learning_rate=inf", lambda: heads.InductionConfig(learning_rate=INF), ValueError,
     ["learning_rate", "inf"]),
    ("InductionConfig half=4", lambda: heads.InductionConfig(half=4), ValueError,
     ["half=4", "default min_period=8", "set min_period too"]),
    ("AttentionOnly 9 tokens", lambda: _attention_only()(torch.zeros(1, 9, dtype=torch.long)), ValueError,
     ["idx", "9 tokens"]),
    ("attention_patterns 9 tokens",
     lambda: heads.attention_patterns(_attention_only(), torch.zeros(1, 9, dtype=torch.long)), ValueError,
     ["idx", "9 tokens"]),
    ("phase_change_step(None, None)", lambda: heads.phase_change_step(None, None), TypeError, ["steps", "None"]),
    ("phase_change_step(object)", lambda: heads.phase_change_step(object(), [1.0, 0.5]), TypeError,
     ["steps", "object"]),
    ("phase_change_step strings", lambda: heads.phase_change_step([0, 1], ["a", "b"]), TypeError,
     ["losses", "'a'"]),
    ("phase_change_step nan", lambda: heads.phase_change_step([0, 1, 2], [2.0, math.nan, 1.0]), ValueError,
     ["losses", "nan", "index 1"]),
    # flash
    ("seconds(None)", lambda: flash_measure.seconds(None), TypeError, ["fn", "None"]),
    ("seconds(tensor)", lambda: flash_measure.seconds(torch.zeros(2)), TypeError, ["fn", "tensor"]),
    ("peak_rss_bytes('fn')", lambda: flash_measure.peak_rss_bytes("fn"), TypeError, ["fn", "'fn'"]),
    # variants
    ("MLA rope_theta=inf", lambda: _mla(rope_theta=INF), ValueError, ["rope_theta", "inf"]),
    ("SlidingWindowAttention rope_theta=inf", lambda: SlidingWindowAttention(8, 2, 4, rope_theta=INF), ValueError,
     ["rope_theta", "inf"]),
    ("rope_rows theta=inf", lambda: rope_rows(4, 0, 3, theta=INF), ValueError, ["theta", "inf"]),
    ("RingKVCache mixed dtypes", lambda: RingKVCache(4).append(torch.randn(1, 1, 2, 4),
                                                               torch.randn(1, 1, 2, 4, dtype=torch.float64)),
     TypeError, ["v:", "torch.float64"]),
    ("RingKVCache mixed devices", lambda: RingKVCache(4).append(torch.randn(1, 1, 2, 4),
                                                                torch.randn(1, 1, 2, 4, device="meta")),
     ValueError, ["v:", "meta"]),
    ("window_mask_at float positions", lambda: window_mask_at(torch.tensor([0.0, 1.0]), torch.arange(2), 2),
     TypeError, ["query_positions", "torch.float32"]),
    ("linear_attention v on meta", lambda: linear_attention(torch.randn(2, 4), torch.randn(2, 4),
                                                            torch.randn(2, 4, device="meta")),
     ValueError, ["v:", "meta"]),
    # hosted set-up
    ("prepare_corpora(None)", lambda: hosted_setup.prepare_corpora(None), ValueError, ["names", "None"]),
    ("finish(corpora=None)", lambda: hosted_setup.finish(corpora=None), ValueError, ["corpora", "None"]),
    ("finish(torch_before=2.13)", lambda: hosted_setup.finish(torch_before=2.13), TypeError,
     ["torch_before", "2.13 (float)"]),
    ("finish(source=123)", lambda: hosted_setup.finish(source=123), TypeError, ["source", "123"]),
    ("hosting(environ=str)", lambda: hosted_setup.hosting(environ="COLAB_RELEASE_TAG"), TypeError,
     ["environ", "'COLAB_RELEASE_TAG'"]),
    ("widget_mode(environ=[])", lambda: hosted_setup.widget_mode("local", environ=[]), TypeError, ["environ", "[]"]),
    # hf
    ("course_attention_forward key.double()", lambda: _forward(key=torch.randn(1, 2, 3, 4).double()), TypeError,
     ["key:", "torch.float64"]),
    ("course_attention_forward value.double()", lambda: _forward(value=torch.randn(1, 2, 3, 4).double()),
     TypeError, ["value:", "torch.float64"]),
]


@pytest.mark.parametrize("call, error, words", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_a_wrong_input_is_refused_naming_the_argument_and_what_was_given(call, error, words):
    with pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    missing = [word for word in words if word not in message]
    assert not missing, f"{missing} not in: {message}"


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_token_ids_of_any_integer_dtype_give_the_logits_of_long_ids(dtype):
    from course_lib.generate import generate
    idx = torch.tensor([[1, 2, 3, 4]])
    for model in (_gpt().eval(), ModernGPT(_modern_config()).eval()):
        assert torch.equal(model(idx.to(dtype)), model(idx))
        out = generate(model, idx.to(dtype), 2, temperature=0.0)
        assert torch.equal(out[:, :4].long(), idx) and out.shape == (1, 6)


def test_online_softmax_gives_nan_for_an_infinite_score_as_torch_softmax_does():
    x = torch.tensor([[INF, 1.0, 2.0], [1.0, 2.0, 3.0], [-INF, -INF, -INF]])
    got = online_softmax(x, 2)
    assert got[0].isnan().all()                                       # torch.softmax: nan, not a silent 0
    assert torch.allclose(got[1], torch.softmax(x[1], dim=-1))
    assert torch.equal(got[2], torch.zeros(3))                        # the documented empty row: zeros
