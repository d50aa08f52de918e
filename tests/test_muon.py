"""The course's Muon: torch.optim.Muon's update and state, with Newton-Schulz in float32 off the GPU."""
import pytest
import torch
import torch.optim._muon as torch_muon

from course_lib.muon import Muon, orthogonalize


def _lopsided(rows, cols, seed=0):
    # singular values from 0.1 to 10: what orthogonalising has to even out
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g))
    k = min(rows, cols)
    return u[:, :k] @ torch.diag(torch.logspace(-1, 1, k)) @ v[:, :k].T


@pytest.mark.parametrize("shape", [(48, 48), (32, 96), (96, 32)])
def test_orthogonalize_evens_out_the_singular_values_and_keeps_the_directions(shape):
    update = _lopsided(*shape)
    out = orthogonalize(update)
    assert out.shape == update.shape and out.dtype == update.dtype
    s = torch.linalg.svdvals(out)
    # from 0.1..10 to the band around 1 that the quintic leaves
    assert s.min() > 0.6 and s.max() < 1.25, s
    # the singular vectors stay: out is close to U V^T of the update
    u, _, vh = torch.linalg.svd(update, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(out.flatten(), (u @ vh).flatten(), dim=0) > 0.95


def test_orthogonalize_takes_a_batch_of_matrices_each_on_its_own():
    batch = torch.stack([_lopsided(16, 40, seed) for seed in range(3)])
    together = orthogonalize(batch)
    assert torch.allclose(together, torch.stack([orthogonalize(m) for m in batch]), atol=1e-5)


def test_orthogonalize_in_bfloat16_is_torch_optim_muons_own():
    update = _lopsided(24, 40)
    ours = orthogonalize(update, 5, torch.bfloat16)
    theirs = torch_muon._zeropower_via_newtonschulz(update, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    # the same iteration; bfloat16 rounds each of its steps a little differently (fused or not)
    assert torch.nn.functional.cosine_similarity(ours.float().flatten(), theirs.float().flatten(), dim=0) > 0.99
    assert (ours.float() - theirs.float()).abs().max() < 0.05


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_step_is_torch_optim_muons_step(monkeypatch, nesterov):
    # torch.optim.Muon with its Newton-Schulz in float32 too: every other part of the step must agree
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz",
                        lambda grad, coefficients, steps, eps: orthogonalize(grad, steps))
    torch.manual_seed(0)
    # wide and tall, so the learning rate's scale differs; a (20, 12) and a second (12, 20) share a batch with
    # the first (12, 20), so each must still get the update it would get alone
    weights = [torch.randn(12, 20), torch.randn(30, 10), torch.randn(20, 12), torch.randn(12, 20)]
    ours = [torch.nn.Parameter(w.clone()) for w in weights]
    theirs = [torch.nn.Parameter(w.clone()) for w in weights]
    options = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    mine, reference = Muon(ours, **options), torch.optim.Muon(theirs, **options)
    for step in range(4):
        for a, b in zip(ours, theirs):
            grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
            a.grad, b.grad = grad.clone(), grad.clone()
        mine.step()
        reference.step()
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-6)


def test_matrices_of_one_shape_in_other_dtypes_each_get_their_own_update():
    # one batch holds one dtype: a float64 matrix beside a float32 one of the same shape is stepped apart
    torch.manual_seed(0)
    weights = [torch.randn(6, 9), torch.randn(6, 9, dtype=torch.float64)]
    together = [torch.nn.Parameter(w.clone()) for w in weights]
    alone = [torch.nn.Parameter(w.clone()) for w in weights]
    for params in (together, alone):
        for p, w in zip(params, weights):
            p.grad = torch.ones_like(w).cumsum(0).sin()
    Muon(together, lr=0.05).step()
    for p in alone:
        Muon([p], lr=0.05).step()
    for a, b in zip(together, alone):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_torch_optim_muon_state_resumes_in_ours():
    # checkpoints written before the course had its own Muon hold torch.optim.Muon's state
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 16))
    reference = torch.optim.Muon([w], lr=0.02)
    w.grad = torch.randn(8, 16)
    reference.step()
    resumed = Muon([torch.nn.Parameter(w.detach().clone())], lr=0.02)
    resumed.load_state_dict(reference.state_dict())
    buffer = reference.state[w]["momentum_buffer"]
    assert torch.equal(next(iter(resumed.state.values()))["momentum_buffer"], buffer)
    resumed.param_groups[0]["params"][0].grad = torch.randn(8, 16)
    resumed.step()   # the old state's extra keys (ns_coefficients, eps, ...) are no obstacle


def test_muon_lowers_a_least_squares_loss():
    torch.manual_seed(0)
    x, target = torch.randn(64, 16), torch.randn(64, 8)
    w = torch.nn.Parameter(torch.zeros(16, 8))
    optimizer = Muon([w], lr=0.05, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = ((x @ w - target) ** 2).mean()
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    best = ((x @ torch.linalg.lstsq(x, target).solution - target) ** 2).mean().item()
    # from 0.30 above the least-squares optimum to within 0.05 of it (a wrong sign or scale diverges)
    assert losses[0] - best > 0.25 and losses[-1] - best < 0.05, (losses, best)


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=0.0), "lr: expected a finite number > 0, got 0.0"),
    (dict(momentum=1.0), r"momentum: expected a number in \[0, 1\), got 1.0"),
    (dict(weight_decay=-0.1), r"weight_decay: expected a finite number in \[0, inf\], got -0.1"),
    (dict(ns_steps=0), "ns_steps: expected a positive int, got 0"),
    (dict(nesterov="yes"), "nesterov: expected True or False, got 'yes'"),
])
def test_muon_names_a_bad_setting(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Muon([torch.nn.Parameter(torch.zeros(3, 3))], **kwargs)


def test_muon_refuses_a_vector_with_the_fix():
    with pytest.raises(ValueError, match=r"params: Muon orthogonalises matrices.*shape \(5,\).*AdamW"):
        Muon([torch.nn.Parameter(torch.zeros(5))])


def test_orthogonalize_names_a_bad_input():
    with pytest.raises(ValueError, match="update"):
        orthogonalize(torch.zeros(5))
    with pytest.raises(ValueError, match="steps: expected a positive int"):
        orthogonalize(torch.zeros(3, 3), 0)
