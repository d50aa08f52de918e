"""course_lib.hf: our GPT next to Hugging Face GPT-2, weight for weight, and our attention inside theirs."""
from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from course_lib import hf
from course_lib.data import REPLACEMENT_CHAR, CharTokenizer
from course_lib.hf.attention_interface import _unregister as unregister
from course_lib.model import GPT, GPTConfig

TOL = 1e-5


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    # Nothing in this file may touch the network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def course_attention():
    name = hf.register_course_attention()
    yield name
    unregister(name)


TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
TEXT_CHARS = sorted(set(TEXT))


def gpt2_config(**kwargs) -> GPT2Config:
    # bos/eos default to OpenAI's 50256, outside these small vocabularies
    return GPT2Config(bos_token_id=None, eos_token_id=None, **kwargs)


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every number random, LayerNorms and biases included, so no tensor can be mapped wrongly unseen."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            is_ln_weight = name.endswith("weight") and p.dim() == 1
            p.copy_(1.0 + 0.2 * noise if is_ln_weight else 0.3 * noise)
    return module.eval()


def random_hf(seed: int = 0, **kwargs) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return randomize(GPT2LMHeadModel(gpt2_config(**kwargs)), seed)


def random_ids(vocab_size: int, shape=(3, 12), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


SIZES = {
    "tied-gelu_new": dict(vocab_size=61, n_positions=16, n_embd=32, n_layer=1, n_head=2),
    "untied-gelu": dict(vocab_size=50, n_positions=20, n_embd=48, n_layer=2, n_head=3,
                        activation_function="gelu", tie_word_embeddings=False),
    "relu-narrow-mlp": dict(vocab_size=70, n_positions=24, n_embd=64, n_layer=3, n_head=4, n_inner=128,
                            activation_function="relu", layer_norm_epsilon=1e-6),
}


# ---------------------------------------------------------------------------
# Weights, both ways
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("size", sorted(SIZES))
def test_logits_agree_both_ways_and_round_trip_is_exact(size):
    hf_model = random_hf(**SIZES[size])
    ids = random_ids(hf_model.config.vocab_size, (3, hf_model.config.n_positions))

    ours = hf.from_hf_gpt2(hf_model)
    assert isinstance(ours, GPT) and not ours.training
    assert ours.config.tie_weights == hf_model.config.tie_word_embeddings
    with torch.no_grad():
        theirs_logits = hf_model(ids).logits
        our_logits = ours(ids)
        back_logits = hf.to_hf_gpt2(ours)(ids).logits
    assert theirs_logits.abs().max() > 1.0   # the comparison below is not between near-zero numbers
    assert max_diff(our_logits, theirs_logits) < TOL
    assert max_diff(back_logits, our_logits) < TOL

    again = hf.from_hf_gpt2(hf.to_hf_gpt2(ours)).state_dict()
    original = ours.state_dict()
    assert again.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(again[name], tensor), name


def test_tied_weights_stay_tied():
    ours = hf.from_hf_gpt2(random_hf(**SIZES["tied-gelu_new"]))
    assert ours.head.weight is ours.token_embedding.weight
    back = hf.to_hf_gpt2(ours)
    assert back.lm_head.weight is back.transformer.wte.weight
    untied = hf.to_hf_gpt2(hf.from_hf_gpt2(random_hf(**SIZES["untied-gelu"])))
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert not torch.equal(untied.lm_head.weight, untied.transformer.wte.weight)


@pytest.mark.parametrize("changes", [dict(bias=False), dict(positional="sinusoidal"), dict(tie_weights=True)])
def test_course_models_export_exactly(changes):
    torch.manual_seed(0)
    config = GPTConfig(**{**dict(vocab_size=40, max_tokens=16, embed_dim=32, num_heads=4, num_layers=2,
                                 activation="gelu_tanh", bias=True), **changes})
    ours = randomize(GPT(config))
    ids = random_ids(40, (2, 16))
    theirs = hf.to_hf_gpt2(ours)
    assert theirs.config.activation_function == "gelu_pytorch_tanh"
    with torch.no_grad():
        assert max_diff(theirs(ids).logits, ours(ids)) < TOL
    if not config.bias:   # GPT-2 always has biases: zeros reproduce a bias-free model
        assert torch.count_nonzero(theirs.transformer.h[0].attn.c_attn.bias) == 0


def test_weight_pairs_name_every_tensor_once():
    config = GPTConfig(vocab_size=30, max_tokens=8, embed_dim=16, num_heads=2, num_layers=3, bias=True)
    pairs = hf.weight_pairs(config.num_layers)
    hf_names = [p.hf for p in pairs]
    course_names = [name for p in pairs for name in p.course]
    assert sorted(hf_names) == sorted(GPT2LMHeadModel(hf.gpt2_config_from_course(config)).state_dict())
    assert sorted(course_names) == sorted(GPT(config).state_dict())
    assert len(set(hf_names)) == len(hf_names) and len(set(course_names)) == len(course_names)
    fused = [p for p in pairs if len(p.course) > 1]
    assert [p.hf for p in fused] == [f"transformer.h.{i}.attn.c_attn.{k}" for i in range(3) for k in ("weight", "bias")]
    assert all(p.conv1d for p in pairs if ".c_" in p.hf)
    assert not any(p.conv1d for p in pairs if ".c_" not in p.hf)
    with pytest.raises(ValueError, match="num_layers"):
        hf.weight_pairs(0)


def test_split_c_attn_gives_linear_weights_of_query_key_value():
    hf_model = random_hf(**SIZES["tied-gelu_new"])
    attn = hf_model.transformer.h[0].attn
    ours = hf.from_hf_gpt2(hf_model).blocks[0].attn
    wq, wk, wv = hf.split_c_attn(attn.c_attn.weight.detach())
    for mine, reference in zip((wq, wk, wv), (ours.query, ours.key, ours.value)):
        assert mine.shape == (32, 32)
        assert torch.equal(mine, reference.weight.detach())
    # what it means: Conv1D computes x @ W, the third for queries equals x @ Wq.T
    x = torch.randn(5, 32)
    with torch.no_grad():
        q_conv1d = (attn.c_attn(x) - attn.c_attn.bias)[:, :32]
    assert max_diff(q_conv1d, x @ wq.T) < TOL

    with pytest.raises(ValueError, match="weight:.*transposed"):
        hf.split_c_attn(attn.c_attn.weight.detach().T)
    with pytest.raises(ValueError, match="weight"):
        hf.split_c_attn(torch.zeros(32, 32))
    with pytest.raises(ValueError, match="weight"):
        hf.split_c_attn(torch.zeros(96))
    with pytest.raises(TypeError, match="weight"):
        hf.split_c_attn([[0.0] * 96] * 32)


def test_shape_mismatches_name_the_tensor():
    hf_model = random_hf(**SIZES["untied-gelu"])
    hf_model.transformer.h[1].mlp.c_fc.weight = nn.Parameter(torch.zeros(48, 100))
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.mlp\.c_fc\.weight.*\(48, 192\).*\(48, 100\)"):
        hf.from_hf_gpt2(hf_model)

    ours = GPT(GPTConfig(vocab_size=30, max_tokens=8, embed_dim=16, num_heads=2, num_layers=2, bias=True))
    ours.blocks[0].attn.key.weight = nn.Parameter(torch.zeros(16, 8))
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.key\.weight"):
        hf.to_hf_gpt2(ours)

    state = hf.from_hf_gpt2(random_hf(**SIZES["tied-gelu_new"]))
    config = state.config
    hf_state = hf.course_to_hf_state_dict(state.state_dict(), config)
    del hf_state["transformer.h.0.ln_2.bias"]
    with pytest.raises(KeyError, match=r"transformer\.h\.0\.ln_2\.bias"):
        hf.hf_to_course_state_dict(hf_state, config)
    with pytest.raises(KeyError, match="unexpected tensor 'extra.weight'"):
        hf.course_to_hf_state_dict({**state.state_dict(), "extra.weight": torch.zeros(1)}, config)


def test_configs_convert_and_refuse_what_they_cannot_express():
    config = hf.course_config_from_gpt2(gpt2_config(vocab_size=10, n_positions=8, n_embd=16, n_head=2,
                                                    n_layer=2, layer_norm_epsilon=1e-6))
    assert (config.vocab_size, config.max_tokens, config.embed_dim, config.num_heads, config.num_layers) == \
        (10, 8, 16, 2, 2)
    assert (config.mlp_ratio, config.activation, config.layer_norm_eps, config.bias, config.tie_weights) == \
        (4, "gelu_tanh", 1e-6, True, True)
    back = hf.gpt2_config_from_course(config)
    assert (back.n_inner, back.activation_function, back.layer_norm_epsilon) == (64, "gelu_pytorch_tanh", 1e-6)
    assert back.bos_token_id is None and back.eos_token_id is None

    base = dict(vocab_size=10, n_positions=8, n_embd=16, n_head=2, n_layer=1)
    for changes, field in [(dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
                           (dict(scale_attn_weights=False), "scale_attn_weights"),
                           (dict(add_cross_attention=True), "add_cross_attention"),
                           (dict(n_inner=40), "n_inner"),
                           (dict(activation_function="silu"), "activation_function")]:
        with pytest.raises(ValueError, match=f"hf_config.{field}"):
            hf.course_config_from_gpt2(gpt2_config(**base, **changes))
    with pytest.warns(UserWarning, match="dropout"):
        assert hf.course_config_from_gpt2(gpt2_config(**base, attn_pdrop=0.0)).dropout_rate == 0.1

    with pytest.raises(ValueError, match="norm_first.*pre-norm"):
        hf.gpt2_config_from_course(GPTConfig(vocab_size=10, norm_first=False))
    with pytest.raises(ValueError, match="norm_first"):
        hf.to_hf_gpt2(GPT(GPTConfig(vocab_size=10, max_tokens=8, embed_dim=16, num_heads=2,
                                    num_layers=1, norm_first=False)))
    with pytest.raises(TypeError, match="config"):
        hf.gpt2_config_from_course({"vocab_size": 10})
    with pytest.raises(TypeError, match="hf_config"):
        hf.course_config_from_gpt2(GPTConfig(vocab_size=10))
    with pytest.raises(TypeError, match="model"):
        hf.to_hf_gpt2(random_hf(**base))
    with pytest.raises(TypeError, match="hf_model"):
        hf.from_hf_gpt2(GPT(GPTConfig(vocab_size=10, max_tokens=8, embed_dim=16, num_heads=2, num_layers=1)))


# ---------------------------------------------------------------------------
# Loading pretrained weights
# ---------------------------------------------------------------------------

def test_from_pretrained_loads_a_save_pretrained_folder(tmp_path):
    hf_model = random_hf(**SIZES["untied-gelu"])
    hf_model.save_pretrained(tmp_path / "tiny-gpt2")
    ours = hf.from_pretrained(str(tmp_path / "tiny-gpt2"))
    ids = random_ids(50, (2, 20))
    with torch.no_grad():
        assert max_diff(ours(ids), hf_model(ids).logits) < TOL
    assert not ours.training


def test_from_pretrained_without_weights_says_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    with pytest.raises(hf.PretrainedWeightsNotFound) as info:
        hf.from_pretrained("course-test-nobody/no-such-gpt2")
    message = str(info.value)
    assert isinstance(info.value, OSError)
    assert "course-test-nobody/no-such-gpt2" in message and "offline" in message
    assert "GPT2LMHeadModel.from_pretrained('course-test-nobody/no-such-gpt2')" in message
    assert "save_pretrained" in message

    with pytest.raises(OSError, match="no folder at"):
        hf.from_pretrained(str(tmp_path / "missing" / "folder"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="no config.json"):
        hf.from_pretrained(tmp_path / "empty")
    transformers.BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=16).save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="'bert'.*GPT-2"):
        hf.from_pretrained(tmp_path / "bert")
    with pytest.raises(TypeError, match="name_or_path"):
        hf.from_pretrained(None)


# ---------------------------------------------------------------------------
# Export for transformers.pipeline
# ---------------------------------------------------------------------------

def tiny_course_gpt(vocab_size: int) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=vocab_size, max_tokens=32, embed_dim=32, num_heads=2, num_layers=2,
                       bias=True, activation="gelu_tanh", tie_weights=True)
    return randomize(GPT(config))


def greedy(model: GPT, ids: list[int], steps: int) -> list[int]:
    idx = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(steps):
            idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx[0].tolist()


def test_char_tokenizer_export_is_one_token_per_character():
    tok = CharTokenizer.from_text(TEXT)
    hf_tok = hf.char_tokenizer_to_hf(tok, model_max_length=32)
    text = "Speak, me\n\nAll: "
    ids = hf_tok(text)["input_ids"]
    assert ids == tok.encode(text)
    assert hf_tok.decode(ids) == text   # no spaces inserted between characters, newlines kept
    assert len(hf_tok) == tok.vocab_size and hf_tok.model_max_length == 32

    with pytest.raises(TypeError, match="tokenizer"):
        hf.char_tokenizer_to_hf("abc")
    with pytest.raises(ValueError, match="tokenizer.stoi"):
        hf.char_tokenizer_to_hf(type("T", (), {"stoi": {"a": 0, "bc": 1}})())
    with pytest.raises(ValueError, match="tokenizer.stoi"):
        hf.char_tokenizer_to_hf(type("T", (), {"stoi": {"a": 0, "b": 2}})())


@pytest.mark.parametrize("unknown", ["error", "skip", "replace"])
def test_char_tokenizer_export_follows_the_unknown_character_policy(unknown):
    tok = CharTokenizer.from_text(TEXT, unknown=unknown)
    hf_tok = hf.char_tokenizer_to_hf(tok)
    known = "hear me\n"
    assert hf_tok(known)["input_ids"] == tok.encode(known)
    unseen = "hear ~me~ 😀"
    if unknown == "error":
        with pytest.raises(ValueError, match="never seen"):
            tok.encode(unseen)
        with pytest.raises(Exception, match="Missing"):   # tokenizers has no unknown token to fall back on
            hf_tok(unseen)
        return
    ids = hf_tok(unseen)["input_ids"]
    assert ids == tok.encode(unseen)
    expected = "hear me " if unknown == "skip" else f"hear {REPLACEMENT_CHAR}me{REPLACEMENT_CHAR} {REPLACEMENT_CHAR}"
    assert hf_tok.decode(ids) == tok.decode(ids) == expected


def test_char_tokenizer_export_refuses_a_replace_policy_without_its_character():
    tok = CharTokenizer.from_text(TEXT, unknown="replace")
    broken = type("T", (), {"stoi": {c: i for i, c in enumerate(TEXT_CHARS)}, "unknown": "replace"})()
    assert len(tok.stoi) == len(broken.stoi) + 1   # CharTokenizer adds the replacement character itself
    with pytest.raises(ValueError, match="tokenizer.stoi.*replace"):
        hf.char_tokenizer_to_hf(broken)
    with pytest.raises(ValueError, match="tokenizer.unknown"):
        hf.char_tokenizer_to_hf(type("T", (), {"stoi": {"a": 0}, "unknown": "drop"})())


def test_save_pretrained_exports_a_model_with_a_replacing_tokenizer(tmp_path):
    tok = CharTokenizer.from_text(TEXT, unknown="replace")
    folder = hf.save_pretrained(tiny_course_gpt(tok.vocab_size), tok, tmp_path / "export")
    reloaded = transformers.AutoTokenizer.from_pretrained(folder)
    assert reloaded("a~b")["input_ids"] == tok.encode("a~b")


def test_pipeline_generates_from_an_exported_char_model(tmp_path):
    tok = CharTokenizer.from_text(TEXT)
    ours = tiny_course_gpt(tok.vocab_size)
    folder = hf.save_pretrained(ours, tok, tmp_path / "export")

    generator = transformers.pipeline("text-generation", model=str(folder), device="cpu")
    prompt = "Before we "
    text = generator(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith(prompt) and len(text) == len(prompt) + 8

    prompt_ids = tok.encode(prompt)
    expected = greedy(ours, prompt_ids, 8)
    produced = generator.model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False)
    assert produced[0].tolist() == expected
    assert text == tok.decode(expected)
    # the pipeline's own default length stays inside the 32-position table
    assert len(generator(prompt, do_sample=False)[0]["generated_text"]) <= 32


def test_pipeline_generates_from_an_exported_subword_model(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")
    ours = tiny_course_gpt(len(tok))
    folder = hf.save_pretrained(ours, tok, tmp_path / "subword")

    config = json.loads((folder / "config.json").read_text())
    assert config["eos_token_id"] == tok.eos_token_id == 0
    assert tok.model_max_length != 32   # the caller's tokenizer is left alone
    generator = transformers.pipeline("text-generation", model=str(folder), device="cpu")
    prompt = "Speak, "
    prompt_ids = tok(prompt)["input_ids"]
    produced = generator.model.generate(torch.tensor([prompt_ids]), max_new_tokens=5, do_sample=False,
                                        eos_token_id=None)
    assert produced[0].tolist() == greedy(ours, prompt_ids, 5)
    assert generator(prompt, max_new_tokens=5, do_sample=False)[0]["generated_text"].startswith(prompt)

    with pytest.raises(ValueError, match="tokenizer: has 300 tokens"):
        hf.save_pretrained(tiny_course_gpt(100), tok, tmp_path / "too-small")
    with pytest.raises(TypeError, match="model"):
        hf.save_pretrained(generator.model, tok, tmp_path / "x")


# ---------------------------------------------------------------------------
# Our attention inside their model
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("by_layer", [False, True])
def test_course_attention_gives_the_logits_of_eager_and_sdpa(course_attention, by_layer):
    # scale_attn_by_inverse_layer_idx only changes the `scaling` GPT-2 passes in
    hf_model = random_hf(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                         scale_attn_by_inverse_layer_idx=by_layer)
    ids = random_ids(61, (3, 12))
    padding = torch.ones(3, 12, dtype=torch.long)
    padding[1, :4] = 0   # left padding, as batched generation does
    padding[2, :7] = 0
    real = padding.bool()

    logits = {}
    for implementation in ("eager", "sdpa", course_attention):
        hf_model.set_attn_implementation(implementation)
        assert hf_model.config._attn_implementation == implementation
        with torch.no_grad():
            logits[implementation] = (hf_model(ids).logits, hf_model(ids, attention_mask=padding).logits)
    plain, padded = logits[course_attention]
    assert not padded.isnan().any()
    assert max_diff(padded[0], plain[0]) < TOL   # the unpadded row is unaffected
    assert max_diff(padded[1, 4:], plain[1, 4:]) > 1e-3   # padding did change what real tokens saw
    for reference in ("eager", "sdpa"):
        assert max_diff(plain, logits[reference][0]) < TOL
        assert max_diff(padded[real], logits[reference][1][real]) < TOL

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[4] is None)
        return hf.course_attention_forward(*args, **kwargs)

    same = hf.run_with_attention(hf_model, counted, ids, padding)
    assert len(calls) == 2 and not any(calls)   # ours ran in both layers, and got the padding mask
    assert max_diff(same[real], logits["eager"][1][real]) < TOL


def test_course_attention_keeps_causality_when_no_mask_is_passed(course_attention):
    hf_model = random_hf(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    ids = random_ids(61, (2, 12))
    changed = ids.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 61
    seen_masks = []

    def ours(module, query, key, value, attention_mask, **kwargs):
        seen_masks.append(attention_mask)
        return hf.course_attention_forward(module, query, key, value, attention_mask, **kwargs)

    before, after = hf.run_with_attention(hf_model, ours, ids), hf.run_with_attention(hf_model, ours, changed)
    assert all(mask is None for mask in seen_masks)   # transformers leaves causality to us here
    assert max_diff(before[:, :8], after[:, :8]) < TOL   # the past does not see the future
    assert max_diff(before[:, 8:], after[:, 8:]) > 1e-3

    def ignores_masks(module, query, key, value, attention_mask, **kwargs):
        return hf.course_attention_forward(module, query, key, value,
                                           torch.ones(1, 1, query.shape[2], key.shape[2], dtype=torch.bool))

    leaky = hf.run_with_attention(hf_model, ignores_masks, ids)
    assert max_diff(leaky[:, :8], hf.run_with_attention(hf_model, ignores_masks, changed)[:, :8]) > 1e-3

    # generation: one query at a time against a growing KV cache
    prompt = ids[:1, :5]
    hf_model.set_attn_implementation("eager")
    expected = hf_model.generate(prompt, max_new_tokens=8, do_sample=False)
    hf_model.set_attn_implementation(course_attention)
    assert torch.equal(hf_model.generate(prompt, max_new_tokens=8, do_sample=False), expected)


def reference_attention(q, k, v, allowed, scaling):
    scores = (q @ k.transpose(-2, -1) * scaling).masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def test_course_attention_forward_masks_scaling_and_grouped_heads():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    out, weights = hf.course_attention_forward(None, q, k, v, None)
    assert out.shape == (2, 5, 4, 8) and weights.shape == (2, 4, 5, 5)
    assert max_diff(out, reference_attention(q, k, v, causal, 8 ** -0.5)) < TOL
    assert max_diff(weights.sum(-1), torch.ones(2, 4, 5)) < TOL

    bidirectional = nn.Module()
    bidirectional.is_causal = False
    out, _ = hf.course_attention_forward(bidirectional, q, k, v, None, scaling=0.3)
    assert max_diff(out, reference_attention(q, k, v, torch.ones(5, 5, dtype=torch.bool), 0.3)) < TOL

    allowed = torch.rand(2, 1, 5, 5, generator=g) > 0.4
    allowed[..., 0] = True
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    from_bool, _ = hf.course_attention_forward(None, q, k, v, allowed)
    from_float, _ = hf.course_attention_forward(None, q, k, v, additive)
    assert torch.equal(from_bool, from_float)
    assert max_diff(from_bool, reference_attention(q, k, v, allowed, 8 ** -0.5)) < TOL

    nobody = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    nobody[0, :, 2] = False   # a query that may see no key gets zeros, not NaN
    out, _ = hf.course_attention_forward(None, q, k, v, nobody)
    assert not out.isnan().any() and torch.count_nonzero(out[0, 2]) == 0

    # grouped-query attention: 2 key/value heads serve 4 query heads
    k2, v2 = k[:, :2], v[:, :2]
    out, _ = hf.course_attention_forward(None, q, k2, v2, None)
    expanded = reference_attention(q, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1), causal, 8 ** -0.5)
    assert max_diff(out, expanded) < TOL


def test_course_attention_bad_inputs_name_the_argument():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="query"):
        hf.course_attention_forward(None, q[0], q, q, None)
    with pytest.raises(TypeError, match="key"):
        hf.course_attention_forward(None, q, q.long(), q, None)
    with pytest.raises(ValueError, match="key"):
        hf.course_attention_forward(None, q, torch.randn(1, 2, 3, 5), q, None)
    with pytest.raises(ValueError, match="key"):
        hf.course_attention_forward(None, q, torch.randn(1, 3, 3, 4), torch.randn(1, 3, 3, 4), None)
    with pytest.raises(ValueError, match="attention_mask"):
        hf.course_attention_forward(None, q, q, q, torch.ones(1, 1, 3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask"):
        hf.course_attention_forward(None, q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask.*bias"):
        hf.course_attention_forward(None, q, q, q, torch.full((1, 1, 3, 3), -0.5))
    with pytest.raises(ValueError, match="scaling"):
        hf.course_attention_forward(None, q, q, q, None, scaling=-1.0)
    with pytest.raises(ValueError, match="dropout"):
        hf.course_attention_forward(None, q, q, q, None, dropout=1.5)


def test_run_with_attention_explains_wrong_outputs_and_restores_the_model():
    hf_model = random_hf(vocab_size=61, n_positions=16, n_embd=32, n_layer=1, n_head=4)
    ids = random_ids(61, (2, 6))
    before = set(transformers.AttentionInterface._global_mapping)

    def forgot_transpose(module, query, key, value, attention_mask, **kwargs):
        out, weights = hf.course_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out.transpose(1, 2), weights

    with pytest.raises(ValueError, match=r"fn: expected attn_output of shape.*\(2, 6, 4, 8\).*transpose"):
        hf.run_with_attention(hf_model, forgot_transpose, ids)
    with pytest.raises(TypeError, match="fn: expected a tuple"):
        hf.run_with_attention(hf_model, lambda *args, **kwargs: args[1], ids)
    # a list of the two is what transformers unpacks as well
    as_list = hf.run_with_attention(hf_model, lambda *args, **kwargs: list(hf.course_attention_forward(*args, **kwargs)),
                                    ids)
    assert torch.equal(as_list, hf.run_with_attention(hf_model, hf.course_attention_forward, ids))
    assert hf_model.config._attn_implementation == "sdpa"
    assert set(transformers.AttentionInterface._global_mapping) == before

    with pytest.raises(TypeError, match="fn"):
        hf.run_with_attention(hf_model, "attention", ids)
    with pytest.raises(TypeError, match="hf_model"):
        hf.run_with_attention(GPT(GPTConfig(vocab_size=61)), hf.course_attention_forward, ids)
    with pytest.raises(TypeError, match="input_ids"):
        hf.run_with_attention(hf_model, hf.course_attention_forward, ids.float())
    with pytest.raises(ValueError, match="attention_mask"):
        hf.run_with_attention(hf_model, hf.course_attention_forward, ids, torch.ones(2, 5))
    for bad in ("sdpa", "", "owner/kernel", 3):
        with pytest.raises(ValueError, match="name"):
            hf.register_course_attention(bad)
    with pytest.raises(TypeError, match="fn"):
        hf.register_course_attention("course_bad", fn=None)
    assert math.isclose(hf_model.transformer.h[0].attn.scaling, 8 ** -0.5)


# ---------------------------------------------------------------------------
# A leaf
# ---------------------------------------------------------------------------

def test_no_course_module_imports_hf_at_import_time():
    # hf is a leaf: the rest of the course must import (and run) without transformers.
    package = Path(hf.__file__).resolve().parents[1]
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if "hf" in path.relative_to(package).parts[:-1]:
            continue
        for node in ast.parse(path.read_text()).body:   # top-level statements only
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" if node.module else a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(name.split(".")[-1] == "hf" or ".hf." in f".{name}." for name in names):
                offenders.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not offenders, f"modules importing course_lib.hf at import time: {offenders}"
    assert "hf" not in (package / "model.py").read_text().replace("hf_", "")



def test_course_attention_without_a_mask_aligns_fewer_queries_with_the_last_keys():
    """Cached decoding: 2 new queries after 3 cached keys see keys 0..3 and 0..4, not 0..0 and 0..1."""
    import types

    from course_lib.hf import course_attention_forward
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    module = types.SimpleNamespace(is_causal=True, training=False)
    out, _ = course_attention_forward(module, query, key, value, None, scaling=0.5)
    scores = (query @ key.transpose(-2, -1)) * 0.5                                  # (1, 2, 2, 5)
    taught = torch.ones(2, 5, dtype=torch.bool).tril(diagonal=3)
    expected = torch.softmax(scores.masked_fill(~taught, float("-inf")), dim=-1) @ value   # (1, 2, 2, 4)
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-6)
