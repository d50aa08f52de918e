"""The attention references agree with PyTorch's own and behave causally."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import (
    TOY_KEYS,
    TOY_VALUES,
    KVCache,
    MaskedAttention,
    MultiHeadMaskedAttention,
    attention_weights,
    causal_mask,
    merge_heads,
    scaled_dot_product_attention,
    split_heads,
    toy_attention,
)

ATTENTION_MODULES = [
    pytest.param(lambda fused: MaskedAttention(16, 12, 0.0, fused=fused), id="MaskedAttention"),
    pytest.param(lambda fused: MultiHeadMaskedAttention(16, 4, 12, 0.0, fused=fused), id="MultiHead-4"),
    pytest.param(lambda fused: MultiHeadMaskedAttention(16, 2, 12, 0.0, fused=fused, bias=True), id="MultiHead-2-bias"),
]


def test_toy_attention_worked_example():
    # query [1, 0]: scores [1, 0, -1], so the first key gets the most weight
    weights = torch.softmax(torch.tensor([1.0, 0.0, -1.0]), 0)
    assert torch.allclose(toy_attention(torch.tensor([1.0, 0.0]), TOY_KEYS, TOY_VALUES), weights @ TOY_VALUES)
    # query [0, 1]: the first and third keys tie, so the result is exactly the middle value
    assert torch.allclose(toy_attention(torch.tensor([0.0, 1.0]), TOY_KEYS, TOY_VALUES), torch.tensor(2.0))


def test_toy_attention_vector_values():
    values = torch.eye(3)
    out = toy_attention(torch.tensor([1.0, 0.0]), TOY_KEYS, values)
    assert out.shape == (3,)
    assert torch.allclose(out, torch.softmax(TOY_KEYS @ torch.tensor([1.0, 0.0]), 0))


@pytest.mark.parametrize("lead", [(), (3,), (2, 4)])
@pytest.mark.parametrize("lq,lk", [(5, 5), (3, 7), (1, 4)])
def test_sdpa_matches_torch(lead, lq, lk):
    torch.manual_seed(0)
    q, k, v = torch.randn(*lead, lq, 8), torch.randn(*lead, lk, 8), torch.randn(*lead, lk, 6)
    mask = torch.rand(lq, lk) > 0.4
    mask[:, 0] = True   # every query may attend somewhere
    ours = scaled_dot_product_attention(q, k, v, mask)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert torch.allclose(scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v), atol=1e-6)


def test_attention_weights_rows_sum_to_one_and_respect_mask():
    q, k = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    w = attention_weights(q, k, causal_mask(6))
    assert torch.allclose(w.sum(-1), torch.ones(2, 6))
    assert (w.triu(1) == 0).all()


def test_mask_broadcasts_over_batch_and_heads():
    q = k = v = torch.randn(2, 3, 5, 4)
    per_batch = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    assert torch.allclose(scaled_dot_product_attention(q, k, v, per_batch),
                          scaled_dot_product_attention(q, k, v, causal_mask(5)), atol=1e-6)


def test_causal_mask():
    m = causal_mask(4)
    assert m.dtype == torch.bool
    assert m.tolist() == [[True, False, False, False], [True, True, False, False],
                          [True, True, True, False], [True, True, True, True]]


@pytest.mark.parametrize("build", ATTENTION_MODULES)
def test_fused_and_plain_paths_agree(build):
    torch.manual_seed(0)
    module = build(True).eval()
    x = torch.randn(3, 9, 16)
    fused = module(x)
    module.fused = False
    assert torch.allclose(fused, module(x), atol=1e-6)


@pytest.mark.parametrize("build", ATTENTION_MODULES)
def test_fused_and_plain_paths_give_the_same_gradients(build):
    # training uses the fused path: its backward pass must give every weight the plain path's gradient
    torch.manual_seed(0)
    module = build(True).train()
    x = torch.randn(3, 9, 16, requires_grad=True)
    grads = {}
    for fused in (True, False):
        module.fused = fused
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).pow(2).sum().backward()
        grads[fused] = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in module.named_parameters()}}
    assert grads[True].keys() == grads[False].keys()
    assert {"query.weight", "key.weight", "value.weight"} <= grads[True].keys()
    for name in grads[True]:
        assert torch.allclose(grads[True][name], grads[False][name], atol=1e-5), name


@pytest.mark.parametrize("build", ATTENTION_MODULES)
def test_module_matches_functional_reference(build):
    torch.manual_seed(1)
    module = build(False).eval()
    x = torch.randn(2, 7, 16)
    heads = module.num_heads
    q, k, v = (split_heads(layer(x), heads) for layer in (module.query, module.key, module.value))
    expected = module.proj(merge_heads(scaled_dot_product_attention(q, k, v, causal_mask(7))))
    assert torch.allclose(module(x), expected, atol=1e-6)


def test_multi_head_matches_torch_multihead_attention():
    torch.manual_seed(2)
    ours = MultiHeadMaskedAttention(16, 4, 10, 0.0).eval()
    theirs = nn.MultiheadAttention(16, 4, bias=False, batch_first=True).eval()
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([ours.query.weight, ours.key.weight, ours.value.weight]))
        theirs.out_proj.weight.copy_(ours.proj.weight)
    x = torch.randn(2, 8, 16)
    expected, _ = theirs(x, x, x, attn_mask=~causal_mask(8), need_weights=False)   # torch: True = blocked
    assert torch.allclose(ours(x), expected, atol=1e-6)


@pytest.mark.parametrize("build", ATTENTION_MODULES)
@pytest.mark.parametrize("fused", [True, False])
def test_future_tokens_never_change_earlier_outputs(build, fused):
    torch.manual_seed(3)
    module = build(fused).eval()
    x = torch.randn(2, 10, 16)
    changed = x.clone()
    changed[:, 6:] = torch.randn(2, 4, 16)
    before, after = module(x), module(changed)
    assert torch.allclose(before[:, :6], after[:, :6], atol=1e-6)
    assert not torch.allclose(before[:, 6:], after[:, 6:])


@pytest.mark.parametrize("build", ATTENTION_MODULES[1:])   # the single-head layer of notebook 02 has no cache
def test_cache_gives_the_same_outputs_as_one_pass(build):
    torch.manual_seed(4)
    module = build(True).eval()
    x = torch.randn(2, 9, 16)
    cache = KVCache(12)
    pieces = [module(x[:, :4], cache), module(x[:, 4:5], cache), module(x[:, 5:], cache)]
    assert cache.length == 9
    assert torch.allclose(torch.cat(pieces, 1), module(x), atol=1e-6)


def test_cache_refuses_to_overflow():
    module = MultiHeadMaskedAttention(8, 2, 4).eval()
    cache = KVCache(4)
    module(torch.randn(1, 4, 8), cache)
    with pytest.raises(ValueError, match="max_tokens"):
        module(torch.randn(1, 1, 8), cache)


@pytest.mark.parametrize("build", ATTENTION_MODULES)
def test_gradients_reach_every_parameter(build):
    module = build(False).train()
    module(torch.randn(2, 5, 16)).square().sum().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("fused", [True, False])
def test_dropout_active_in_train_and_off_in_eval(fused):
    torch.manual_seed(5)
    module = MultiHeadMaskedAttention(16, 4, 12, 0.5, fused=fused)
    x = torch.randn(2, 8, 16)
    module.train()
    assert not torch.allclose(module(x), module(x))
    module.eval()
    assert torch.equal(module(x), module(x))


def test_parameter_names_are_the_taught_ones():
    names = {n for n, _ in MaskedAttention(8, 4, 0.0).named_parameters()}
    assert names == {"query.weight", "key.weight", "value.weight", "proj.weight"}
    assert MultiHeadMaskedAttention(8, 2, 4, 0.0).head_dim == 4


@pytest.mark.parametrize("fused", [True, False])
def test_single_head_layer_is_one_head_of_the_multi_head_layer(fused):
    # notebook 03 builds on notebook 02: with one head the two layers compute the same thing
    torch.manual_seed(6)
    single = MaskedAttention(16, 12, 0.0, fused=fused).eval()
    multi = MultiHeadMaskedAttention(16, 1, 12, 0.0, fused=fused).eval()
    multi.load_state_dict(single.state_dict())
    x = torch.randn(2, 7, 16)
    assert torch.allclose(single(x), multi(x), atol=1e-6)
    for module in (single, multi):
        module.record_weights = True
        module(x)
    assert single.attention_weights.shape == (2, 1, 7, 7)   # laid out (N, heads, L, L), as notebook 02 reads it
    assert torch.allclose(single.attention_weights, multi.attention_weights, atol=1e-6)


def test_split_heads_cuts_features_not_positions():
    x = torch.arange(2 * 3 * 4.0).view(2, 3, 4)
    heads = split_heads(x, 2)
    assert heads.shape == (2, 2, 3, 2)
    assert torch.equal(heads[0, 1, 2], x[0, 2, 2:])   # head 1 at position 2: the second half of the features
    assert torch.equal(merge_heads(heads), x)


@pytest.mark.parametrize("call,match", [
    (lambda: toy_attention([1.0, 0.0], TOY_KEYS, TOY_VALUES), "query"),
    (lambda: toy_attention(torch.tensor([1.0, 0.0, 0.0]), TOY_KEYS, TOY_VALUES), "keys"),
    (lambda: toy_attention(torch.tensor([1.0, 0.0]), TOY_KEYS, torch.ones(4)), "values"),
    (lambda: scaled_dot_product_attention(torch.randn(3, 4), torch.randn(3, 5), torch.randn(3, 2)), "k"),
    (lambda: scaled_dot_product_attention(torch.randn(3, 4), torch.randn(5, 4), torch.randn(4, 2)), "v"),
    (lambda: scaled_dot_product_attention(torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 2),
                                          torch.ones(3, 4, dtype=torch.bool)), "mask"),
    (lambda: scaled_dot_product_attention(torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 2),
                                          torch.ones(3, 5)), "mask"),
    (lambda: scaled_dot_product_attention(torch.ones(3, 4, dtype=torch.long), torch.randn(5, 4),
                                          torch.randn(5, 2)), "q"),
    (lambda: causal_mask(0), "n"),
    (lambda: MultiHeadMaskedAttention(10, 3, 8), "num_heads"),
    (lambda: MaskedAttention(8, 4, 1.5), "dropout_rate"),
    (lambda: MaskedAttention(8, 4)(torch.randn(1, 5, 8)), "max_tokens"),
    (lambda: MaskedAttention(8, 4)(torch.randn(5, 8)), "x"),
    (lambda: MaskedAttention(8, 4)(torch.randn(1, 3, 6)), "embed_dim"),
    (lambda: MaskedAttention(0, 4), "embed_dim"),
    (lambda: MaskedAttention(8, 4, fused="yes"), "fused"),
    (lambda: MultiHeadMaskedAttention(8, 2, 4, bias=1), "bias"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()
