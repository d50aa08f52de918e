"""Notebook 10's Triton kernel on a GPU, beside PyTorch's SDPA: ``python -m course_lib bench triton``.

Times the compiled kernel (``flash_triton.flash_attention_triton``) in full float32 (``ieee``) and in TF32
against ``scaled_dot_product_attention`` in float32 and bfloat16, with the largest difference from a
float64 reference; then the peak memory of naive, tiled (PyTorch) and Triton attention and SDPA against L.
On a machine without CUDA the command says so in one line: the kernel then only runs in Triton's
interpreter (notebook 10 section 6), whose times say nothing about a GPU.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from .. import _validate as validate
from .. import flash, flash_triton

__all__ = ["check_sizes", "triton_benchmark", "memory_benchmark", "print_triton"]


def _median_ms(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):   # compiling and caches first
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _kernel() -> Any:
    module = flash_triton.load()
    if module is None:
        raise RuntimeError(f"the Triton kernel cannot run here: {flash_triton.UNAVAILABLE}")
    return module


def check_sizes(lengths: Sequence[int], head_dims: Sequence[int], heads: int, repeats: int) -> None:
    """Refuse sizes the kernel cannot take, naming the argument."""
    for length in lengths:
        validate.positive_int("lengths", length)
    for head_dim in head_dims:
        if validate.positive_int("head_dims", head_dim) < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"head_dims: expected powers of two of at least 16 (tl.dot's smallest tile), "
                             f"got {head_dim}")
    validate.positive_int("heads", heads)
    validate.positive_int("repeats", repeats)


def triton_benchmark(lengths: Sequence[int] = (1024, 4096, 16384), head_dims: Sequence[int] = (64, 128), *,
                     heads: int = 16, repeats: int = 10, device: str | torch.device = "cuda") -> list[dict]:
    """One row per (head dim, causal, L): milliseconds per call and the largest difference from float64."""
    check_sizes(lengths, head_dims, heads, repeats)
    device, kernel, rows = torch.device(device), _kernel(), []
    for head_dim in head_dims:
        for causal in (False, True):
            for length in lengths:
                generator = torch.Generator(device=device).manual_seed(0)
                q, k, v = (torch.randn(1, heads, length, head_dim, device=device, generator=generator)
                           for _ in range(3))                                          # (1, heads, L, d)
                exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
                row = {"head_dim": head_dim, "causal": causal, "length": length}
                for precision in ("ieee", "tf32"):
                    block_k = 32 if precision == "ieee" and head_dim > 64 else 64   # fp32 tiles fill shared memory
                    run = partial(kernel.flash_attention_triton, q, k, v, block_q=64, block_k=block_k,
                                  causal=causal, precision=precision)
                    row[f"{precision}_ms"] = _median_ms(run, repeats, device)
                    row[f"{precision}_diff"] = float((run()[0] - exact).abs().max())
                sdpa = F.scaled_dot_product_attention
                row["sdpa_fp32_ms"] = _median_ms(partial(sdpa, q, k, v, is_causal=causal), repeats, device)
                row["sdpa_bf16_ms"] = _median_ms(partial(sdpa, *(t.bfloat16() for t in (q, k, v)), is_causal=causal),
                                                 repeats, device)
                rows.append(row)
    return rows


def memory_benchmark(lengths: Sequence[int] = (1024, 4096, 16384), *, heads: int = 4, head_dim: int = 64,
                     tiled_up_to: int = 4096, device: str | torch.device = "cuda") -> list[dict]:
    """Peak memory above the inputs (MiB), causal, per method and L; the PyTorch tiles only up to
    ``tiled_up_to`` (a Python loop over blocks). Needs CUDA's memory counters."""
    device, kernel, rows = torch.device(device), _kernel(), []
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device for its memory counters, got {device}")
    for length in lengths:
        q, k, v = (torch.randn(1, heads, length, head_dim, device=device) for _ in range(3))
        methods = {"naive": partial(flash.naive_attention, q, k, v, causal=True),
                   "tiled": partial(flash.flash_attention, q, k, v, causal=True) if length <= tiled_up_to else None,
                   "triton": partial(kernel.flash_attention_triton, q, k, v, block_q=64, block_k=64, causal=True),
                   "sdpa": partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)}
        row: dict[str, Any] = {"length": length}
        for name, call in methods.items():
            if call is None:
                row[name] = None
                continue
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = call()
            torch.cuda.synchronize()
            row[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
            del out
        rows.append(row)
    return rows


def print_triton(rows: list[dict], memory: list[dict], device_name: str) -> None:
    print(f"on {device_name}: ms per call (median), largest |difference| from float64")
    print(f"{'d':>4}{'causal':>8}{'L':>7}{'ieee':>9}{'tf32':>9}{'sdpa fp32':>10}{'sdpa bf16':>10}"
          f"{'ieee diff':>11}{'tf32 diff':>11}")
    for r in rows:
        print(f"{r['head_dim']:>4}{'yes' if r['causal'] else 'no':>8}{r['length']:>7}{r['ieee_ms']:>9.3f}"
              f"{r['tf32_ms']:>9.3f}{r['sdpa_fp32_ms']:>10.3f}{r['sdpa_bf16_ms']:>10.3f}{r['ieee_diff']:>11.1e}"
              f"{r['tf32_diff']:>11.1e}")
    if memory:
        print("\npeak memory above the inputs, MiB (float32, causal)")
        print(f"{'L':>7}{'naive':>10}{'tiled':>10}{'triton':>10}{'sdpa':>10}")
        for r in memory:
            print(f"{r['length']:>7}" + "".join(f"{'not run':>10}" if r[m] is None else f"{r[m]:>10.1f}"
                                                for m in ("naive", "tiled", "triton", "sdpa")))
