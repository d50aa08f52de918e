"""course_lib.hf.families and .qwen3: every ModernGPT option a transformers decoder has, both ways.

QK-norm as Qwen 3, a sliding window as Mistral (or Qwen 3 with QK-norm), the ReLU² MLP as Arcee (or
Apertus with QK-norm): logits within 1e-5 both ways on random tiny models, at lengths longer than the
window, and greedy generation with our KV cache gives transformers' tokens.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    ApertusForCausalLM,
    ArceeForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from course_lib import hf
from course_lib.generate import generate, generate_with_cache
from course_lib.modern import GroupedQueryAttention
from course_lib.modern_gpt import ModernGPT, ModernGPTConfig

TOL = 1e-5   # float32, logits of standard deviation about 1
LENGTH = 32  # every window below is shorter


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def course_config(**changes) -> ModernGPTConfig:
    values = dict(vocab_size=61, max_tokens=LENGTH, embed_dim=48, num_heads=6, num_kv_heads=2, num_layers=2,
                  hidden_dim=80, rope_theta=5000.0, norm_eps=1e-5)
    values.update(changes)
    return ModernGPTConfig(**values)


# name -> (ModernGPT options, the transformers class it must become)
CASES = {
    "qwen3-gqa-tied": (dict(qk_norm=True, tie_weights=True), Qwen3ForCausalLM),
    "qwen3-mqa-head_dim16-theta500000": (dict(qk_norm=True, num_heads=4, num_kv_heads=1, head_dim=16,
                                              rope_theta=500000.0), Qwen3ForCausalLM),
    "qwen3-window5": (dict(qk_norm=True, sliding_window=5), Qwen3ForCausalLM),
    "mistral-window7-tied": (dict(sliding_window=7, tie_weights=True), MistralForCausalLM),
    "mistral-window1": (dict(sliding_window=1), MistralForCausalLM),
    "arcee-relu2": (dict(mlp="relu2"), ArceeForCausalLM),
    "apertus-relu2-qk_norm-head_dim12": (dict(mlp="relu2", qk_norm=True, head_dim=12, norm_eps=1e-6),
                                         ApertusForCausalLM),
    "llama": (dict(), LlamaForCausalLM),
}


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every number random, norm weights included, so no tensor can be mapped wrongly unseen."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1.0 + 0.2 * noise if p.dim() == 1 else 0.15 * noise)
    return module.eval()


def tokens(n: int, length: int = LENGTH, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 61, (n, length), generator=torch.Generator().manual_seed(seed))


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def random_hf(name: str, seed: int = 0) -> nn.Module:
    """A random transformers model of the case's class, built from transformers' own config class."""
    changes, cls = CASES[name]
    family = hf.family_for(course_config(**changes))
    torch.manual_seed(seed)
    return randomize(cls(hf.hf_config_from_course(family, course_config(**changes))), seed)


# ---------------------------------------------------------------- both ways

@pytest.mark.parametrize("name", list(CASES))
def test_each_option_goes_to_the_family_that_has_it_with_the_same_logits(name):
    changes, cls = CASES[name]
    torch.manual_seed(0)
    ours = randomize(ModernGPT(course_config(**changes)), seed=3)
    theirs = hf.to_hf_modern(ours)
    assert type(theirs) is cls and not theirs.training
    c = theirs.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (ours.config.num_heads,
                                                                          ours.config.num_kv_heads,
                                                                          ours.config.head_dim)
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": ours.config.rope_theta}
    assert c.tie_word_embeddings == ours.config.tie_weights and c.rms_norm_eps == ours.config.norm_eps
    assert c.hidden_act == ("relu2" if ours.config.mlp == "relu2" else "silu")
    idx = tokens(3)
    with torch.no_grad():
        expected = ours(idx)
        assert expected.std() > 0.5   # large enough that a wrong mapping shows
        assert max_difference(theirs(idx).logits, expected) < TOL


@pytest.mark.parametrize("name", list(CASES))
def test_from_hf_gives_the_same_logits_config_and_weights_back(name):
    changes, cls = CASES[name]
    theirs = random_hf(name)
    ours = hf.from_hf_modern(theirs)
    expected_config = course_config(**changes)
    assert ours.config == expected_config
    assert (ours.head.weight is ours.token_embedding.weight) == expected_config.tie_weights
    idx = tokens(2, seed=2)
    with torch.no_grad():
        assert max_difference(ours(idx), theirs(idx).logits) < TOL
    back = hf.to_hf_modern(ours).state_dict()
    for key, tensor in theirs.state_dict().items():
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize("name", ["qwen3-window5", "mistral-window7-tied", "apertus-relu2-qk_norm-head_dim12"])
def test_greedy_generation_past_the_window_with_our_cache_gives_transformers_tokens(name):
    theirs = random_hf(name)
    ours = hf.from_hf_modern(theirs)
    prompt = tokens(2, 6, seed=3)
    expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                               do_sample=False, pad_token_id=0)
    assert expected.shape == (2, 26)
    assert torch.equal(generate(ours, prompt, 20, temperature=0), expected)
    assert torch.equal(generate_with_cache(ours, prompt, 20), expected)


@pytest.mark.parametrize("name, window", [("qwen3-window5", 5), ("mistral-window7-tied", 7)])
def test_the_window_counts_the_token_itself(name, window):
    """A window of w sees the token and the w - 1 before it on both sides: one more or one less shows."""
    theirs = random_hf(name)
    ours = hf.from_hf_modern(theirs)
    assert ours.config.sliding_window == window
    idx = tokens(2, seed=4)
    with torch.no_grad():
        expected = theirs(idx).logits
        assert max_difference(ours(idx), expected) < TOL
        for wrong in (window - 1, window + 1):
            for block in ours.blocks:
                block.attn.sliding_window = wrong
            assert max_difference(ours(idx), expected) > 1e-2, wrong
            # up to the window, every window agrees: the difference is past it
            assert max_difference(ours(idx[:, :min(window, wrong)]), expected[:, :min(window, wrong)]) < TOL


def test_a_qwen3_made_by_its_own_config_loads_with_its_window_and_norms():
    hf_config = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=LENGTH,
                            use_sliding_window=True, sliding_window=6, max_window_layers=0, rms_norm_eps=1e-6,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    theirs = randomize(Qwen3ForCausalLM(hf_config), seed=6)
    ours = hf.from_hf_qwen3(theirs)
    assert (ours.config.qk_norm, ours.config.sliding_window, ours.config.head_dim) == (True, 6, 8)
    assert torch.equal(ours.blocks[1].attn.k_norm.weight, theirs.model.layers[1].self_attn.k_norm.weight)
    idx = tokens(2, seed=7)
    with torch.no_grad():
        assert max_difference(ours(idx), theirs(idx).logits) < TOL
        assert max_difference(hf.to_hf_qwen3(ours)(idx).logits, theirs(idx).logits) == 0.0
    plain = Qwen3Config(**{**hf_config.to_dict(), "use_sliding_window": False, "layer_types": None})
    assert hf.course_config_from_qwen3(plain).sliding_window is None


def test_a_student_attention_with_qk_norm_loads_a_qwen3():
    class Subclassed(GroupedQueryAttention):
        pass

    theirs = random_hf("qwen3-window5")
    ours = hf.from_hf_qwen3(theirs, attention_cls=Subclassed)
    assert type(ours.blocks[0].attn) is Subclassed
    idx = tokens(1, seed=8)
    with torch.no_grad():
        assert max_difference(ours(idx), theirs(idx).logits) < TOL

    class Plain(GroupedQueryAttention):
        def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0):
            super().__init__(embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta)

    with pytest.raises(TypeError, match="attention_cls: Plain does not take qk_norm, norm_eps, sliding_window"):
        hf.from_hf_qwen3(theirs, attention_cls=Plain)


# ---------------------------------------------------------------- which family, and refusals

@pytest.mark.parametrize("changes, family", [
    (dict(), "Llama"), (dict(sliding_window=4), "Mistral"), (dict(qk_norm=True), "Qwen 3"),
    (dict(qk_norm=True, sliding_window=4), "Qwen 3"), (dict(mlp="relu2"), "Arcee"),
    (dict(mlp="relu2", qk_norm=True), "Apertus"),
])
def test_family_for_reads_the_config(changes, family):
    assert hf.family_for(course_config(**changes)).name == family


@pytest.mark.parametrize("changes, match", [
    (dict(ngram_prior=7, prior_features=True),
     r"^ours.config.ngram_prior: no transformers architecture can express ngram_prior=7 \(a counted n-gram model"),
    (dict(hashed_ngrams=3), r"^ours.config.hashed_ngrams: no transformers architecture can express hashed_ngrams=3"),
    (dict(mlp="relu2", sliding_window=4),
     r"^ours.config.sliding_window: no transformers architecture has both mlp='relu2' .* and sliding_window=4; "
     r"mlp='swiglu' converts"),
])
def test_what_no_architecture_has_is_refused_in_one_line(changes, match):
    ours = ModernGPT(course_config(**changes))
    with pytest.raises(ValueError, match=match) as refused:
        hf.to_hf_modern(ours)
    assert "\n" not in str(refused.value) and "mlp='relu2' as Arcee" in str(refused.value)


@pytest.mark.parametrize("function, changes, match", [
    (hf.to_hf_qwen3, dict(), r"^ours.config.qk_norm: a Qwen 3 cannot express qk_norm=False \(Qwen 3 always "
                             r"normalises each query and key head; this model converts as Llama\); only a "
                             r"ModernGPT with qk_norm=True"),
    (hf.to_hf_qwen3, dict(qk_norm=True, mlp="relu2"), r"^ours.config.mlp: a Qwen 3 cannot express mlp='relu2' "
                                                      r"\(.*this model converts as Apertus\)"),
    (hf.to_hf_llama, dict(sliding_window=3), r"^ours.config.sliding_window: a Llama cannot express "
                                             r"sliding_window=3 \(.*this model converts as Mistral\)"),
])
def test_a_named_family_refuses_what_it_lacks_and_says_which_converts(function, changes, match):
    with pytest.raises(ValueError, match=match):
        function(ModernGPT(course_config(**changes)))


def qwen3_config(**changes) -> Qwen3Config:
    values = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=16)
    values.update(changes)
    return Qwen3Config(**values)


@pytest.mark.parametrize("changes, match", [
    (dict(attention_bias=True), r"model.config.attention_bias: .*no bias \(query, key, value, proj\)"),
    (dict(hidden_act="gelu"), r"model.config.hidden_act: .*hidden_act='gelu'.*SiLU"),
    (dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
     r"model.config.layer_types: the course model gives every layer the same attention; got 1 sliding and 1 full"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
     r"model.config.rope_parameters: rope_type='linear'"),
])
def test_from_hf_qwen3_refuses_what_the_course_model_cannot_express(changes, match):
    with pytest.raises(ValueError, match=match):
        hf.from_hf_qwen3(Qwen3ForCausalLM(qwen3_config(**changes)))


def test_from_hf_refuses_other_models_and_other_activations():
    llama = hf.to_hf_llama(ModernGPT(course_config()))
    with pytest.raises(TypeError, match="model: expected a transformers.Qwen3ForCausalLM, got"):
        hf.from_hf_qwen3(llama)
    with pytest.raises(TypeError, match="model: expected one of transformers' LlamaForCausalLM, MistralForCausalLM"):
        hf.from_hf_modern(nn.Linear(2, 2))
    arcee = random_hf("arcee-relu2")
    arcee.config.hidden_act = "silu"
    with pytest.raises(ValueError, match=r"model.config.hidden_act: .*squares a ReLU \(hidden_act='relu2'\)"):
        hf.from_hf_modern(arcee)
    with pytest.raises(TypeError, match="ours: expected a course_lib ModernGPT"):
        hf.to_hf_qwen3(llama)


@pytest.mark.parametrize("family", hf.FAMILIES, ids=lambda f: f.name)
def test_each_weight_table_names_every_tensor_once(family):
    changes = dict(qk_norm=family.qk_norm, mlp=family.mlp, sliding_window=4 if family.window else None)
    config = course_config(**changes)
    assert hf.family_for(config) is family or family.name == "Qwen 3" and not family.window
    pairs = hf.modern_weight_pairs(family, 2)
    theirs = family.model_class(hf.hf_config_from_course(family, config))
    assert sorted(name for name, _ in pairs) == sorted(ModernGPT(config).state_dict())
    assert sorted(name for _, name in pairs) == sorted(theirs.state_dict())
    assert len(set(pairs)) == len(pairs)


@pytest.mark.parametrize("name", ["apertus-relu2-qk_norm-head_dim12", "qwen3-window5", "mistral-window1"])
def test_a_saved_folder_keeps_what_the_family_config_does_not_declare(tmp_path, name):
    """Apertus's config has no head_dim field (it reads one when given); Qwen 3 keeps its window in
    layer_types: both must survive save_pretrained and AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM

    theirs = hf.to_hf_modern(hf.from_hf_modern(random_hf(name)))
    theirs.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(theirs) and loaded.config.head_dim == theirs.config.head_dim
    assert hf.from_hf_modern(loaded).config == hf.from_hf_modern(theirs).config
    idx = tokens(1, seed=9)
    with torch.no_grad():
        assert max_difference(loaded(idx).logits, theirs(idx).logits) == 0.0
