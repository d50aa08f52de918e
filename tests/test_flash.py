"""course_lib.flash (online softmax, tiled forward, recomputing backward), flash_measure and flash_triton."""
from __future__ import annotations

import math
import os

import pytest
import torch

from course_lib import flash, flash_measure, flash_triton


@pytest.mark.parametrize("block", [1, 3, 4, 50])
def test_online_softmax_equals_softmax_and_survives_large_scores(block):
    x = torch.randn(3, 2, 10) * 4
    assert torch.allclose(flash.online_softmax(x, block), torch.softmax(x, -1), atol=1e-6)
    big = torch.tensor([[500.0, 10.0, -400.0, 499.0, -1000.0]])     # exp(500) overflows float32
    assert torch.allclose(flash.online_softmax(big, 2), torch.softmax(big, -1))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [(4, 4), (4, 3), (16, 5), (64, 64)])
def test_flash_attention_equals_naive_with_its_log_sum_exp(causal, blocks):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 13, 8, dtype=torch.float64) * 2 for _ in range(3))
    out, lse = flash.flash_attention(q, k, v, block_q=blocks[0], block_k=blocks[1], causal=causal)
    ref_out, ref_lse = flash.naive_attention(q, k, v, causal=causal)
    assert torch.allclose(out, ref_out, atol=1e-12) and torch.allclose(lse, ref_lse, atol=1e-12)


def test_flash_attention_float32_within_1e5_and_more_keys_than_queries():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 7, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    out, lse = flash.flash_attention(q, k, v, block_q=4, block_k=6)
    ref_out, ref_lse = flash.naive_attention(q, k, v)
    assert (out - ref_out).abs().max() <= 1e-5 and (lse - ref_lse).abs().max() <= 1e-5


def test_flash_attention_rejects_bad_inputs_naming_the_argument():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="block_q"):
        flash.flash_attention(q, q, q, block_q=0, block_k=2)
    with pytest.raises(ValueError, match="causal"):
        flash.flash_attention(q, torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8), block_q=2, block_k=2,
                              causal=True)
    with pytest.raises(ValueError, match="^k:"):
        flash.flash_attention(q, torch.randn(1, 1, 4, 6), q, block_q=2, block_k=2)
    with pytest.raises(TypeError, match="^q:"):
        flash.flash_attention([1.0], q, q, block_q=2, block_k=2)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_equals_autograd_through_the_naive_version(causal):
    torch.manual_seed(2)
    leaves = [torch.randn(2, 2, 11, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    grad_out = torch.randn(2, 2, 11, 4, dtype=torch.float64)
    ours = torch.autograd.grad(flash.FlashAttentionFunction.apply(*leaves, causal, 4, 3), leaves, grad_out)
    theirs = torch.autograd.grad(flash.naive_attention(*leaves, causal=causal)[0], leaves, grad_out)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-12)


def test_backward_saves_no_square_tensor():
    q = torch.randn(1, 1, 32, 4, requires_grad=True)
    out = flash.FlashAttentionFunction.apply(q, q, q, True, 8, 8)
    assert all(t.numel() < 32 * 32 for t in out.grad_fn.saved_tensors)


def test_causal_blocks_counts_the_blocks_on_and_below_the_diagonal():
    assert flash.causal_blocks(64, 16, 16) == (10, 16)
    assert flash.causal_blocks(64, 16, 8) == (20, 32)
    assert flash.causal_blocks(10, 4, 4) == (6, 9)
    needed, total = flash.causal_blocks(4096, 32, 32)
    assert 0.5 < needed / total < 0.51


def test_score_bytes():
    assert flash.score_bytes(16384) == 2**30
    assert flash.score_bytes(10, heads=2, batch=3, bytes_per_number=2) == 1200


def test_peak_tensor_bytes_sees_the_square_matrix_and_not_the_tiles():
    q = torch.randn(1, 1, 256, 16)
    naive = flash_measure.peak_tensor_bytes(lambda: flash.naive_attention(q, q, q))
    tiled = flash_measure.peak_tensor_bytes(lambda: flash.flash_attention(q, q, q, block_q=32, block_k=32))
    assert naive >= 2 * flash.score_bytes(256) > flash.score_bytes(256) > tiled
    assert flash_measure.peak_tensor_bytes(lambda: torch.ones(1000)) == 4000
    with pytest.raises(TypeError, match="fn"):
        flash_measure.peak_tensor_bytes(3)


def test_traffic_bytes_quadratic_against_linear():
    naive = [flash_measure.traffic_bytes(n, 64) for n in (1024, 2048)]
    tiled = [flash_measure.traffic_bytes(n, 64, block_q=128) for n in (1024, 2048)]
    assert naive[1] / naive[0] > 3.5 and tiled[1] / tiled[0] < 4.01
    assert flash_measure.traffic_bytes(16, 4, bytes_per_number=1) == 2 * 64 + 4 * 256 + 2 * 64


def test_seconds_and_rss_return_numbers():
    assert flash_measure.seconds(lambda: None, repeats=2) >= 0
    rss = flash_measure.peak_rss_bytes(lambda: torch.ones(10))
    assert rss is None or rss >= 0


def test_triton_section_degrades_or_matches():
    module = flash_triton.load()
    if module is None:
        assert flash_triton.UNAVAILABLE, "a missing Triton must say why"
        return
    on = "cuda" if torch.cuda.is_available() else "cpu"   # the kernel is compiled on a GPU, interpreted on a CPU
    torch.manual_seed(3)
    q, k, v = torch.randn(3, 1, 1, 40, 16).to(on).unbind(0)
    out, lse = module.flash_attention_triton(q, k, v, block_q=16, block_k=16, causal=True)
    ref_out, ref_lse = flash.naive_attention(q, k, v, causal=True)
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
    with pytest.raises(ValueError, match="block_q"):
        module.flash_attention_triton(q, k, v, block_q=12, block_k=16)
    with pytest.raises(ValueError, match="num_warps: expected a power of two from 1 to 32, got 6"):
        module.flash_attention_triton(q, k, v, num_warps=6)
    with pytest.raises(ValueError, match="precision: expected one of"):
        module.flash_attention_triton(q, k, v, precision="fp16")
    eight, _ = module.flash_attention_triton(q, k, v, block_q=16, block_k=16, causal=True, num_warps=8)
    assert torch.allclose(eight, ref_out, atol=1e-5)   # the warps change the speed, never the result
    tf32, _ = module.flash_attention_triton(q, k, v, causal=True, precision="tf32")   # runs; exact only in ieee
    assert torch.allclose(tf32, ref_out, atol=1e-2)
    with pytest.raises(ValueError, match=f"q: expected a {'CUDA' if on == 'cuda' else 'CPU'} tensor"):
        module.flash_attention_triton(q.to("meta"), k, v)   # a tensor on another device is refused in one line


def test_an_interpreter_that_cannot_loop_to_an_argument_skips_the_section_saying_why(monkeypatch):
    # Triton 3.6's interpreter fails on this kernel's loop (seen with NumPy 2.4 and 2.5): the section is
    # skipped in one line instead of raising InterpreterError in the student's cell
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(flash_triton, "_interpreter_loops_to_an_argument", lambda: False)
    monkeypatch.setattr(flash_triton, "_imported_without_interpreter", lambda: False)
    assert flash_triton.load() is None
    assert "cannot run a loop whose bound is a kernel argument" in flash_triton.UNAVAILABLE
    monkeypatch.undo()
    if flash_triton.load() is not None:   # where it can: the reason is gone again
        assert flash_triton.UNAVAILABLE == ""


def test_the_pinned_triton_runs_the_kernel_where_there_is_no_gpu():
    # in a fresh process (in this one another test may have imported Triton before the interpreter was chosen)
    import subprocess
    import sys
    pytest.importorskip("triton")
    probe = ("from course_lib import flash_triton\n"
             "assert flash_triton.load() is not None, flash_triton.UNAVAILABLE\n"
             "print(flash_triton._interpreter_loops_to_an_argument())\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.stdout.split() == ["True"], done.stderr[-2000:]


def test_scale_is_one_over_sqrt_d():
    q = torch.zeros(1, 1, 3, 4)
    k = torch.zeros(1, 1, 3, 4)
    q[..., 0, 0], k[..., 1, 0] = 2.0, 3.0                # one score of 6 before scaling, 3 after
    _, lse = flash.flash_attention(q, k, torch.zeros(1, 1, 3, 4), block_q=2, block_k=2)
    assert math.isclose(float(lse[0, 0, 0]), math.log(2 + math.exp(3.0)), rel_tol=1e-6)
