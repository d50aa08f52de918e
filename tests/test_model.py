"""Positional encodings, blocks and the GPT model."""
import math

import pytest
import torch

from course_lib import (
    GPT,
    FeedForward,
    GPTConfig,
    LearnedPositionalEncoding,
    SinusoidalPositionalEncoding,
    TransformerBlock,
    sinusoidal_table,
)


def small_config(**overrides):
    values = dict(vocab_size=13, max_tokens=16, embed_dim=32, num_heads=4, num_layers=2)
    values.update(overrides)
    return GPTConfig(**values)


def test_sinusoidal_table_matches_the_paper():
    table = sinusoidal_table(10, 6)
    pos, i = 7, 1
    assert torch.isclose(table[pos, 2 * i], torch.tensor(math.sin(pos / 10000 ** (2 * i / 6))))
    assert torch.isclose(table[pos, 2 * i + 1], torch.tensor(math.cos(pos / 10000 ** (2 * i / 6))))
    assert sinusoidal_table(5, 7).shape == (5, 7)   # odd sizes work too


def test_positional_encodings_give_vectors_per_position():
    learned = LearnedPositionalEncoding(8, 4)
    assert torch.equal(learned(3, start=2), learned.embedding.weight[2:5])
    fixed = SinusoidalPositionalEncoding(8, 4)
    assert torch.equal(fixed(3, start=2), sinusoidal_table(8, 4)[2:5])
    assert list(fixed.parameters()) == []
    with pytest.raises(ValueError, match="max_tokens"):
        learned(5, start=4)


def test_feed_forward_shapes_and_names():
    ff = FeedForward(8, dropout_rate=0.0)
    assert ff(torch.randn(2, 3, 8)).shape == (2, 3, 8)
    assert {n for n, _ in ff.named_parameters()} == {"fc.weight", "proj.weight"}
    assert ff.fc.out_features == 32


@pytest.mark.parametrize("norm_first", [True, False])
def test_block_follows_its_norm_placement(norm_first):
    torch.manual_seed(0)
    block = TransformerBlock(16, 4, 8, 0.0, norm_first=norm_first).eval()
    x = torch.randn(2, 5, 16)
    if norm_first:
        h = x + block.attn(block.ln1(x))
        expected = h + block.mlp(block.ln2(h))
    else:
        h = block.ln1(x + block.attn(x))
        expected = block.ln2(h + block.mlp(h))
    assert torch.allclose(block(x), expected, atol=1e-6)
    # the two placements really differ
    other = TransformerBlock(16, 4, 8, 0.0, norm_first=not norm_first).eval()
    other.load_state_dict(block.state_dict())
    assert not torch.allclose(block(x), other(x), atol=1e-4)


def test_block_attribute_names():
    block = TransformerBlock(8, 2, 4)
    for name in ("ln1", "attn", "ln2", "mlp"):
        assert hasattr(block, name)


@pytest.mark.parametrize("overrides", [{}, {"norm_first": False}, {"positional": "sinusoidal"},
                                       {"tie_weights": True}, {"fused_attention": False},
                                       {"bias": True, "activation": "gelu_tanh"}])
def test_gpt_is_causal(overrides):
    torch.manual_seed(1)
    model = GPT(small_config(**overrides)).eval()
    idx = torch.randint(0, 13, (2, 12))
    changed = idx.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 13
    before, after = model(idx), model(changed)
    assert before.shape == (2, 12, 13)
    assert torch.allclose(before[:, :8], after[:, :8], atol=1e-5)
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_gpt_uses_positions():
    torch.manual_seed(2)
    model = GPT(small_config()).eval()
    logits = model(torch.full((1, 6), 3))
    assert not torch.allclose(logits[0, 1], logits[0, 5])


def test_gpt_cache_matches_full_forward():
    torch.manual_seed(3)
    model = GPT(small_config()).eval()
    idx = torch.randint(0, 13, (3, 11))
    cache = model.new_cache()
    pieces = [model(idx[:, :6], cache)] + [model(idx[:, i:i + 1], cache) for i in range(6, 11)]
    assert torch.allclose(torch.cat(pieces, 1), model(idx), atol=1e-5)


def test_parameter_count_by_hand():
    c = small_config()
    e, v, t, layers = c.embed_dim, c.vocab_size, c.max_tokens, c.num_layers
    per_block = 2 * (2 * e) + 4 * e * e + 2 * 4 * e * e   # two LayerNorms, q/k/v/proj, fc and proj
    expected = v * e + t * e + layers * per_block + 2 * e + v * e
    assert GPT(c).num_parameters() == expected
    tied = GPT(small_config(tie_weights=True))
    assert tied.num_parameters() == expected - v * e
    assert tied.head.weight is tied.token_embedding.weight
    assert GPT(c).num_parameters(include_embeddings=False) == expected - t * e


def test_gradients_reach_every_parameter():
    model = GPT(small_config(dropout_rate=0.1)).train()
    model(torch.randint(0, 13, (2, 10))).logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_dropout_in_train_mode_only():
    torch.manual_seed(4)
    model = GPT(small_config(dropout_rate=0.3))
    idx = torch.randint(0, 13, (2, 10))
    model.train()
    assert not torch.allclose(model(idx), model(idx))
    model.eval()
    assert torch.equal(model(idx), model(idx))


def test_attention_maps_shape_and_rows():
    model = GPT(small_config())
    maps = model.attention_maps(torch.randint(0, 13, (2, 7)))
    assert maps.shape == (2, 2, 4, 7, 7)
    assert torch.allclose(maps.sum(-1), torch.ones(2, 2, 4, 7), atol=1e-5)
    assert (maps.triu(1) == 0).all()
    assert model.training   # restored


def test_config_round_trip():
    c = small_config(tie_weights=True)
    assert GPTConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown field"):
        GPTConfig.from_dict({**c.to_dict(), "n_embd": 3})
    with pytest.raises(TypeError, match=r"values: expected a dict from GPTConfig.to_dict\(\), got"):
        GPTConfig.from_dict([("embed_dim", 32)])


@pytest.mark.parametrize("overrides,match", [
    ({"embed_dim": 30}, "divisible by num_heads"),
    ({"num_layers": 0}, "num_layers"),
    ({"vocab_size": -1}, "vocab_size"),
    ({"dropout_rate": 1.0}, "dropout_rate"),
    ({"positional": "rotary"}, "positional"),
    ({"activation": "swish"}, "activation"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"input_init_std": 0}, r"GPTConfig.input_init_std: expected a finite number > 0, got 0.*GPT-2 uses 0.02"),
    ({"input_init_std": float("inf")}, "input_init_std"),
    ({"input_init_std": True}, "input_init_std"),
])
def test_config_validates_itself(overrides, match):
    with pytest.raises(ValueError, match=match):
        small_config(**overrides)


def test_config_messages_say_what_to_do_and_flags_must_be_bools():
    with pytest.raises(ValueError, match=r"GPTConfig.dropout_rate: .*0.0 turns dropout off"):
        small_config(dropout_rate=-0.1)
    with pytest.raises(ValueError, match=r"GPTConfig.layer_norm_eps: expected a number > 0"):
        small_config(layer_norm_eps=0)
    with pytest.raises(TypeError, match=r"GPTConfig.tie_weights: expected True or False, got 'yes'"):
        small_config(tie_weights="yes")


def test_input_init_std_sets_the_matrices_that_read_the_stream_and_only_those():
    torch.manual_seed(0)
    gpt2 = GPT(small_config(embed_dim=64, tie_weights=True))
    torch.manual_seed(0)
    wider = GPT(small_config(embed_dim=64, tie_weights=True, input_init_std=0.05))
    reads_the_stream = ("attn.query.weight", "attn.key.weight", "attn.value.weight", "mlp.fc.weight")
    for (name, before), (_, after) in zip(gpt2.named_parameters(), wider.named_parameters()):
        if name.endswith(reads_the_stream):
            assert abs(before.std().item() - 0.02) < 0.004, name      # GPT-2's spread by default
            assert abs(after.std().item() - 0.05) < 0.006, name
        else:   # the embeddings, the shrunk output projections, the norms: GPT-2's draws, unchanged
            assert torch.equal(before, after), name


def test_gpt_input_errors():
    model = GPT(small_config())
    with pytest.raises(ValueError, match="longer than max_tokens=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(TypeError, match="idx"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="idx"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="config"):
        GPT({"vocab_size": 3})
