"""course_lib.heads: the head scores, ablate_head, the repeated-token data and the attention-only model."""
from __future__ import annotations

import pytest
import torch

from course_lib import GPT, GPTConfig, heads


def _weights(n=2, h=3, length=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, h, length, length, generator=g)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1)     # (N, heads, L, L)


def test_previous_token_score_of_a_perfect_previous_token_head_is_one():
    length = 6
    perfect = torch.zeros(2, 3, length, length)
    perfect[..., 0, 0] = 1.0
    perfect[..., torch.arange(1, length), torch.arange(length - 1)] = 1.0
    perfect[:, 1] = torch.eye(length)                                   # head 1 attends to itself
    assert torch.allclose(heads.previous_token_score(perfect), torch.tensor([1.0, 0.0, 1.0]))


def test_induction_score_of_a_perfect_induction_head_is_one():
    half = 4
    w = torch.zeros(1, 2, 2 * half, 2 * half)
    w[..., 0] = 1.0
    for i in range(half, 2 * half):
        w[0, 0, i] = 0.0
        w[0, 0, i, i - half + 1] = 1.0                                  # head 0: the token after the copy
    assert torch.allclose(heads.induction_score(w, half), torch.tensor([1.0, 0.0]))


def test_scores_average_the_right_entries_and_are_differentiable():
    w = _weights().requires_grad_(True)
    manual = torch.stack([w[:, :, i, i - 1] for i in range(1, 8)], -1).mean(dim=(0, 2))
    assert torch.allclose(heads.previous_token_score(w), manual)
    manual = torch.stack([w[:, :, i, i - 3] for i in range(4, 8)], -1).mean(dim=(0, 2))
    score = heads.induction_score(w, 4)
    assert torch.allclose(score, manual)
    score.sum().backward()
    assert torch.allclose(w.grad.sum(), torch.tensor(3.0))             # 1/count per entry, one per head


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(2, 3, 4), "weights"), (torch.zeros(1, 2, 3, 4), "square"), ([[0.5]], "weights"),
])
def test_scores_refuse_wrong_weights(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        heads.previous_token_score(bad)


def test_induction_score_refuses_a_half_outside_the_sequence():
    with pytest.raises(ValueError, match="half"):
        heads.induction_score(_weights(length=8), 8)
    with pytest.raises(ValueError, match="half"):
        heads.induction_score(_weights(length=8), 0)


def test_repeated_tokens_repeat():
    x = heads.repeated_tokens(3, 5, 10, generator=torch.Generator().manual_seed(0))
    assert x.shape == (3, 10) and torch.equal(x[:, :5], x[:, 5:])
    y = heads.repeated_tokens(2, 3, 10, length=8)
    assert y.shape == (2, 8) and torch.equal(y[:, :3], y[:, 3:6]) and torch.equal(y[:, :2], y[:, 6:])
    with pytest.raises(ValueError, match="vocab_size"):
        heads.repeated_tokens(2, 3, 0)


def _small():
    torch.manual_seed(0)
    return heads.AttentionOnly(heads.InductionConfig(vocab_size=11, half=4, embed_dim=12, num_heads=3,
                                                     min_period=2)).eval()


@pytest.mark.parametrize("build", [_small, lambda: GPT(GPTConfig(vocab_size=11, max_tokens=8, embed_dim=12,
                                                                     num_heads=3, num_layers=2, bias=True)).eval()])
def test_ablate_head_zeroes_exactly_that_head_and_restores(build):
    model = build()
    idx = torch.randint(11, (2, 8), generator=torch.Generator().manual_seed(1))
    seen = []
    handle = model.blocks[1].attn.proj.register_forward_hook(lambda m, inp, out: seen.append(inp[0].clone()))
    with torch.no_grad():
        before = model(idx)
        with heads.ablate_head(model, 1, 2) as inside:
            ablated = model(idx)
        after = model(idx)
    handle.remove()
    assert inside is model
    merged = seen[1]                                                    # (N, L, heads * head_dim) as proj saw it
    assert merged[..., 8:].abs().max() == 0 and merged[..., :8].abs().min() > 0
    assert not torch.allclose(before, ablated) and torch.equal(before, after)
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_ablate_head_restores_after_an_exception_and_lets_it_through():
    model = _small()
    with pytest.raises(KeyError), heads.ablate_head(model, 0, 0):
        raise KeyError("inside")
    assert all(not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("layer,head,match", [(2, 0, "layer"), (0, 3, "head"), (-1, 0, "layer")])
def test_ablate_head_refuses_what_the_model_does_not_have(layer, head, match):
    with pytest.raises(ValueError, match=match), heads.ablate_head(_small(), layer, head):
        pass


def test_attention_patterns_of_the_attention_only_model_and_a_modern_gpt():
    model = _small()
    idx = torch.randint(11, (2, 8))
    maps = heads.attention_patterns(model, idx)
    assert maps.shape == (2, 2, 3, 8, 8)
    assert torch.allclose(maps.sum(-1), torch.ones(2, 2, 3, 8))
    assert maps.triu(1).abs().max() == 0
    assert not model.blocks[0].attn.record_weights
    from course_lib.modern_gpt import ModernGPT, ModernGPTConfig
    modern = ModernGPT(ModernGPTConfig(vocab_size=11, max_tokens=8, embed_dim=16, num_heads=4, num_kv_heads=2,
                                       num_layers=2, qk_norm=True)).eval()
    maps = heads.attention_patterns(modern, idx)
    assert maps.shape == (2, 2, 4, 8, 8) and maps.triu(1).abs().max() == 0
    # the recomputed weights reproduce what the layer computed
    from course_lib.attention import merge_heads, split_heads
    from course_lib.modern import repeat_kv
    attn, seen = modern.blocks[1].attn, {}
    handle = attn.register_forward_hook(lambda m, inp, out: seen.update(x=inp[0], out=out))
    with torch.no_grad():
        modern(idx)
        v = repeat_kv(split_heads(attn.value(seen["x"]), attn.num_kv_heads), attn.groups)   # (N, heads, L, hd)
        again = attn.proj(merge_heads(maps[1] @ v))
    handle.remove()
    assert torch.allclose(again, seen["out"], atol=1e-5)


def test_phase_change_step_finds_the_steepest_drop():
    assert heads.phase_change_step([0, 10, 20, 30], [4.0, 3.9, 1.0, 0.9]) == 20
    with pytest.raises(ValueError, match="steps"):
        heads.phase_change_step([0], [1.0])


@pytest.mark.slow
def test_training_shows_the_phase_change_and_the_two_heads():
    run = heads.train_induction()
    assert run.second_half[run.steps.index(200)] > 3.5 and run.second_half[-1] < 1.0 < 4.0 < run.first_half[-1]
    probe = heads.repeated_tokens(32, 16, 64, generator=torch.Generator().manual_seed(3))
    maps = heads.attention_patterns(run.model, probe)
    prev = torch.stack([heads.previous_token_score(w) for w in maps])
    ind = torch.stack([heads.induction_score(w, 16) for w in maps])
    assert prev.shape == ind.shape == (2, 1), "one head per layer"
    assert prev[0, 0] > 3 * prev[1, 0], "layer 0's head looks at the previous token"
    assert ind[1, 0] > 4 * ind[0, 0], "layer 1's head is the induction head, far above the other"
    with heads.ablate_head(run.model, 1, 0):
        _, ablated = heads.half_losses(run.model, probe, 16)
    _, clean = heads.half_losses(run.model, probe, 16)
    assert ablated > clean + 2.0, "without the induction head the repeat cannot be copied"
