"""Notebook 12's reference, part 3 (course_lib.variants.linear): linear attention, parallel and recurrent."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib.variants import elu_feature_map, linear_attention, linear_attention_recurrent


def qkv(shape: tuple[int, ...], d_v: int, dtype=torch.float64, seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)
    k = (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)
    v = torch.randn(*shape[:-1], d_v, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def by_definition(q, k, v, causal=True):
    """o_i = sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j), over j <= i, one query at a time."""
    phi = lambda t: torch.where(t > 0, t + 1, torch.exp(t))   # noqa: E731  elu(t) + 1 written out
    length = q.shape[-2]
    rows = []
    for i in range(length):
        seen = slice(0, i + 1) if causal else slice(0, length)
        weights = (phi(q[..., i, None, :]) * phi(k[..., seen, :])).sum(-1)        # (..., j)
        rows.append((weights[..., None] * v[..., seen, :]).sum(-2) / weights.sum(-1, keepdim=True))
    return torch.stack(rows, dim=-2)


def test_the_feature_map_is_elu_plus_one_and_positive():
    x = torch.tensor([-30.0, -2.0, 0.0, 0.5, 3.0], dtype=torch.float64)
    torch.testing.assert_close(elu_feature_map(x), torch.tensor([torch.exp(torch.tensor(-30.0)).item(),
                                                                 torch.exp(torch.tensor(-2.0)).item(), 1.0, 1.5, 4.0],
                                                                dtype=torch.float64))
    wide = torch.linspace(-80, 80, 1001)
    assert (elu_feature_map(wide) > 0).all()   # float32, where elu(x) + 1 would round to 0 below -17
    torch.testing.assert_close(elu_feature_map(wide.double()), F.elu(wide.double()) + 1, rtol=1e-12, atol=1e-12)
    x = torch.tensor([-100.0, 0.0, 100.0], dtype=torch.float64, requires_grad=True)
    elu_feature_map(x).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad[2] == 1


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape, d_v", [((7, 4), 4), ((2, 3, 9, 5), 3), ((1, 1, 1, 2), 6)])
def test_the_parallel_form_is_the_definition(shape, d_v, causal):
    q, k, v = qkv(shape, d_v)
    torch.testing.assert_close(linear_attention(q, k, v, causal=causal, eps=0.0), by_definition(q, k, v, causal),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shape, d_v", [((2, 3, 17, 8), 8), ((4, 11, 6), 5), ((1, 2, 40, 4), 9)])
def test_the_recurrence_gives_the_parallel_outputs(shape, d_v, dtype, atol):
    q, k, v = qkv(shape, d_v, dtype, seed=1)
    out, (s, z) = linear_attention_recurrent(q, k, v)
    assert out.dtype == dtype and out.shape == v.shape
    assert s.shape == (*shape[:-2], shape[-1], d_v) and z.shape == (*shape[:-2], shape[-1])   # d x d_v, not L
    torch.testing.assert_close(out, linear_attention(q, k, v), rtol=0, atol=atol)


def test_the_state_carries_a_sequence_on():
    q, k, v = qkv((2, 2, 12, 4), 3, seed=2)
    whole, (s, z) = linear_attention_recurrent(q, k, v)
    first, state = linear_attention_recurrent(q[..., :5, :], k[..., :5, :], v[..., :5, :])
    kept = tuple(t.clone() for t in state)
    second, (s2, z2) = linear_attention_recurrent(q[..., 5:, :], k[..., 5:, :], v[..., 5:, :], state)
    torch.testing.assert_close(torch.cat([first, second], dim=-2), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(s2, s, rtol=0, atol=1e-12)
    torch.testing.assert_close(z2, z, rtol=0, atol=1e-12)
    # the state passed in is not changed in place
    assert torch.equal(state[0], kept[0]) and torch.equal(state[1], kept[1])
    # and it is the sums the docstring names
    fk = F.elu(k) + 1
    torch.testing.assert_close(s, fk.transpose(-2, -1) @ v, rtol=0, atol=1e-12)
    torch.testing.assert_close(z, fk.sum(-2), rtol=0, atol=1e-12)


def test_reading_the_state_before_adding_the_token_would_differ():
    # a counter-example the test above rests on: the first output is v_0 exactly, because query 0 sees key 0
    q, k, v = qkv((1, 5, 3), 2, seed=3)
    out, _ = linear_attention_recurrent(q, k, v, eps=0.0)
    torch.testing.assert_close(out[..., 0, :], v[..., 0, :], rtol=0, atol=1e-12)


def test_very_negative_features_stay_finite():
    q, k, v = qkv((1, 6, 4), 4, dtype=torch.float32, scale=200.0, seed=4)
    assert torch.isfinite(linear_attention(q, k, v)).all()
    assert torch.isfinite(linear_attention_recurrent(q, k, v)[0]).all()


@pytest.mark.parametrize("form", ["parallel", "recurrent"])
def test_gradients_flow_and_inputs_stay(form):
    q, k, v = qkv((2, 5, 3), 4, seed=5)
    run = (lambda a, b, c: linear_attention(a, b, c)) if form == "parallel" else \
        (lambda a, b, c: linear_attention_recurrent(a, b, c)[0])
    copies = [t.clone() for t in (q, k, v)]
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(run, inputs)
    run(*inputs).sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in inputs)
    assert all(torch.equal(a.detach(), b) for a, b in zip(inputs, copies))


def test_both_forms_give_the_same_gradients():
    q, k, v = qkv((2, 9, 4), 3, seed=6)
    grads = []
    for run in (lambda a, b, c: linear_attention(a, b, c), lambda a, b, c: linear_attention_recurrent(a, b, c)[0]):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        (run(*inputs) * torch.linspace(-1, 1, 3, dtype=torch.float64)).sum().backward()
        grads.append([t.grad for t in inputs])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_bad_arguments_are_named():
    q, k, v = qkv((2, 5, 3), 4)
    with pytest.raises(ValueError, match="k: expected the shape of q"):
        linear_attention(q, k[..., :2], v)
    with pytest.raises(ValueError, match="v: expected shape"):
        linear_attention_recurrent(q, k, v[:, :4])
    with pytest.raises(TypeError, match="q, k, v: expected one dtype"):
        linear_attention(q, k.float(), v)
    with pytest.raises(TypeError, match="state: expected None or the"):
        linear_attention_recurrent(q, k, v, state=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="state: expected S"):
        linear_attention_recurrent(q, k, v, state=(torch.zeros(2, 3, 3, dtype=torch.float64),
                                                   torch.zeros(2, 3, dtype=torch.float64)))
    with pytest.raises(TypeError, match="q: expected a floating-point"):
        linear_attention(q.long(), k, v)
