"""course_lib.hf.llama: our ModernGPT next to Hugging Face Llama, weight for weight, both ways."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from course_lib import hf
from course_lib.attention import KVCache
from course_lib.generate import generate, generate_with_cache
from course_lib.model import GPT, GPTConfig
from course_lib.modern import GroupedQueryAttention, RMSNorm, SwiGLU
from course_lib.modern_gpt import ModernGPT, ModernGPTConfig

TOL = 1e-5   # float32, logits of standard deviation about 1


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    # Nothing in this file may touch the network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def llama_config(**kwargs) -> LlamaConfig:
    values = dict(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                  bos_token_id=None, eos_token_id=None)   # Llama's defaults (1, 2) mean nothing here
    values.update(kwargs)
    return LlamaConfig(**values)


# Two architectures: GQA with a non-default theta, tied; MQA-like groups of 4, untied, with a head_dim
# that is not hidden_size / num_heads and Llama 3's theta.
CONFIGS = {
    "gqa-tied-theta5000": dict(tie_word_embeddings=True),
    "gqa-untied-theta500000-head_dim16": dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
}


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every number random, norm weights included, so no tensor can be mapped wrongly unseen."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1.0 + 0.2 * noise if p.dim() == 1 else 0.15 * noise)
    return module.eval()


def random_llama(seed: int = 0, **kwargs) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return randomize(LlamaForCausalLM(llama_config(**kwargs)), seed)


def tokens(n: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 61, (n, length), generator=torch.Generator().manual_seed(seed))


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------- logits, both ways

@pytest.mark.parametrize("name", list(CONFIGS))
def test_from_hf_llama_gives_the_same_logits_and_config(name):
    theirs = random_llama(**CONFIGS[name])
    ours = hf.from_hf_llama(theirs)
    c, t = ours.config, theirs.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (t.num_attention_heads, t.num_key_value_heads, t.head_dim)
    assert c.rope_theta == t.rope_parameters["rope_theta"] and c.norm_eps == 1e-5
    assert c.tie_weights == t.tie_word_embeddings and c.max_tokens == 32 and c.hidden_dim == 80
    assert (ours.head.weight is ours.token_embedding.weight) == c.tie_weights
    assert not ours.training
    idx = tokens(3, 32)
    with torch.no_grad():
        expected = theirs(idx).logits
        assert expected.std() > 0.5   # large enough that a wrong mapping shows
        assert max_difference(ours(idx), expected) < TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_to_hf_llama_gives_the_same_logits_and_the_same_weights_back(name):
    theirs = random_llama(**CONFIGS[name])
    ours = randomize(hf.from_hf_llama(theirs), seed=5)   # new numbers, set on our side
    back = hf.to_hf_llama(ours)
    assert isinstance(back, LlamaForCausalLM) and not back.training
    assert back.config.rope_parameters == theirs.config.rope_parameters
    assert back.config.num_key_value_heads == theirs.config.num_key_value_heads
    assert back.config.tie_word_embeddings == theirs.config.tie_word_embeddings
    idx = tokens(2, 32, seed=2)
    with torch.no_grad():
        assert max_difference(back(idx).logits, ours(idx)) < TOL
    again = hf.to_hf_llama(hf.from_hf_llama(theirs)).state_dict()
    for key, tensor in theirs.state_dict().items():
        assert torch.equal(again[key], tensor), key


def test_dtype_context_and_training_mode_carry_over():
    theirs = random_llama().double().train()
    ours = hf.from_hf_llama(theirs, max_tokens=16)
    assert ours.training and ours.config.max_tokens == 16
    assert ours.token_embedding.weight.dtype == torch.float64
    idx = tokens(2, 16)
    with torch.no_grad():
        assert max_difference(ours.eval()(idx), theirs.eval()(idx).logits) < TOL
    assert hf.to_hf_llama(ours).lm_head.weight.dtype == torch.float64


# ---------------------------------------------------------------- generation

@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_with_our_cache_gives_transformers_tokens(name):
    theirs = random_llama(**CONFIGS[name])
    ours = hf.from_hf_llama(theirs)
    prompt = tokens(2, 6, seed=3)
    expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                               do_sample=False, pad_token_id=0)
    assert expected.shape == (2, 26)
    assert torch.equal(generate(ours, prompt, 20, temperature=0), expected)
    assert torch.equal(generate_with_cache(ours, prompt, 20), expected)


# ---------------------------------------------------------------- a student's own parts

class StudentAttention(nn.Module):
    """Written apart from the reference: its own tables, repeat_interleave, explicit softmax."""

    def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.query = nn.Linear(embed_dim, num_heads * self.head_dim, bias=False)
        self.key = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.value = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=False)
        inverse = rope_theta ** -(torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.arange(max_tokens).float()[:, None] * inverse
        self.register_buffer("angles", torch.cat([angles, angles], dim=-1), persistent=False)

    def rotate(self, x, start):
        angles = self.angles[start:start + x.shape[2]]
        half = x.shape[-1] // 2
        return x * angles.cos() + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * angles.sin()

    def forward(self, x, cache=None):
        n, length, _ = x.shape
        start = cache.length if cache is not None else 0
        q = self.query(x).view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.key(x).view(n, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.value(x).view(n, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotate(q, start), self.rotate(k, start)
        if cache is not None:
            k, v = cache.append(k, v)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        total = start + length
        future = torch.ones(length, total, dtype=torch.bool).triu(start + 1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(n, length, -1))


class StudentRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class StudentSwiGLU(nn.Module):
    def __init__(self, embed_dim, hidden_dim):
        super().__init__()
        self.gate = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.up = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, embed_dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SubclassedAttention(GroupedQueryAttention):
    """The reference under another name, with the plain signature a notebook gives."""

    def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0):
        super().__init__(embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta)


@pytest.mark.parametrize("parts", [
    dict(attention_cls=StudentAttention, norm_cls=StudentRMSNorm, mlp_cls=StudentSwiGLU),
    dict(attention_cls=SubclassedAttention, norm_cls=type("Norm", (RMSNorm,), {}), mlp_cls=type("MLP", (SwiGLU,), {})),
], ids=["written-apart", "subclasses"])
def test_a_llama_loads_into_other_classes_and_agrees(parts):
    theirs = random_llama(**CONFIGS["gqa-tied-theta5000"])
    ours = hf.from_hf_llama(theirs, **parts)
    assert type(ours.blocks[1].attn) is parts["attention_cls"] and type(ours.norm_f) is parts["norm_cls"]
    assert type(ours.blocks[0].mlp) is parts["mlp_cls"]
    idx = tokens(2, 32)
    with torch.no_grad():
        assert max_difference(ours(idx), theirs(idx).logits) < TOL
    prompt = tokens(1, 4, seed=4)
    expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                               do_sample=False, pad_token_id=0)
    assert torch.equal(generate(ours, prompt, 12, temperature=0), expected)
    with torch.no_grad():
        assert max_difference(hf.to_hf_llama(ours)(idx).logits, theirs(idx).logits) == 0.0


class MisnamedAttention(StudentAttention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wq = self.query
        del self.query


class BiasedSwiGLU(StudentSwiGLU):
    def __init__(self, embed_dim, hidden_dim):
        super().__init__(embed_dim, hidden_dim)
        self.up = nn.Linear(embed_dim, hidden_dim, bias=True)


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(attention_bias=True), ValueError, r"model.config.attention_bias: .*no bias \(query, key, value, proj\)"),
    (dict(mlp_bias=True), ValueError, r"model.config.mlp_bias: .*SwiGLU has no bias"),
    (dict(hidden_act="gelu"), ValueError, r"model.config.hidden_act: .*hidden_act='gelu'.*SiLU"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), ValueError,
     r"model.config.rope_parameters: rope_type='linear' rescales RoPE's frequencies.*rope_type='default'"),
])
def test_from_hf_llama_refuses_what_the_course_model_cannot_express(kwargs, error, match):
    with pytest.raises(error, match=match):
        hf.from_hf_llama(LlamaForCausalLM(llama_config(num_hidden_layers=1, **kwargs)))


def test_from_hf_llama_refuses_other_models_and_misnamed_parts():
    with pytest.raises(TypeError, match="model: expected a transformers.LlamaForCausalLM, got"):
        hf.from_hf_llama(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=11)))
    theirs = random_llama(num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"attention_cls: .*parameter 'blocks.0.attn.wq.weight' with no counterpart"):
        hf.from_hf_llama(theirs, attention_cls=MisnamedAttention)
    with pytest.raises(ValueError, match=r"mlp_cls: .*'blocks.0.mlp.up.bias' with no counterpart in the Llama"):
        hf.from_hf_llama(theirs, mlp_cls=BiasedSwiGLU)
    with pytest.raises(ValueError, match="max_tokens: expected a positive int"):
        hf.from_hf_llama(theirs, max_tokens=0)


@pytest.mark.parametrize("overrides,match", [
    (dict(qk_norm=True), r"ours.config.qk_norm: a Llama cannot express qk_norm=True"),
    (dict(sliding_window=4), r"ours.config.sliding_window: a Llama cannot express sliding_window=4"),
    (dict(mlp="relu2"), r"ours.config.mlp: a Llama cannot express mlp='relu2'"),
])
def test_to_hf_llama_refuses_what_llama_cannot_express(overrides, match):
    config = ModernGPTConfig(vocab_size=11, max_tokens=8, embed_dim=16, num_heads=2, num_layers=1, **overrides)
    with pytest.raises(ValueError, match=match):
        hf.to_hf_llama(ModernGPT(config))


def test_to_hf_llama_refuses_a_gpt_and_names_the_argument():
    with pytest.raises(TypeError, match="ours: expected a course_lib ModernGPT, got"):
        hf.to_hf_llama(GPT(GPTConfig(vocab_size=11, max_tokens=8, embed_dim=16, num_heads=2, num_layers=1)))
    with pytest.raises(TypeError, match="hf_config: expected a transformers.LlamaConfig"):
        hf.course_config_from_llama(GPT2Config())
    with pytest.raises(TypeError, match="config: expected a course_lib ModernGPTConfig"):
        hf.llama_config_from_course(GPTConfig(vocab_size=11))


def test_weight_table_names_every_tensor_once():
    pairs = hf.llama_weight_pairs(2)
    ours = ModernGPT(ModernGPTConfig(vocab_size=11, max_tokens=8, embed_dim=16, num_heads=2, num_layers=2))
    theirs = LlamaForCausalLM(llama_config(num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                                           num_key_value_heads=2, vocab_size=11))
    assert sorted(name for name, _ in pairs) == sorted(ours.state_dict())
    assert sorted(name for _, name in pairs) == sorted(theirs.state_dict())
    assert ("blocks.1.attn.proj.weight", "model.layers.1.self_attn.o_proj.weight") in pairs
    assert ("blocks.0.mlp_norm.weight", "model.layers.0.post_attention_layernorm.weight") in pairs
    assert {"from_hf_llama", "to_hf_llama", "llama_weight_pairs"} <= set(hf.__all__)
    assert isinstance(ours.new_cache()[0], KVCache)
