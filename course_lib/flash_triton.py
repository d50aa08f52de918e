"""The tiled FlashAttention forward of ``course_lib.flash`` as a Triton kernel (notebook 10, section 6).

Triton is an optional extra (``pip install attention-course[triton]``, Linux only). Without a GPU, Triton's
interpreter runs the kernel on CPU tensors: importing this module sets ``TRITON_INTERPRET=1`` first when
no CUDA device is present (the interpreter is chosen when a kernel is defined). Import it through
:func:`load`, which returns None, with the reason, where Triton is missing.
"""
from __future__ import annotations

import functools
import math
import os
import sys
from types import ModuleType

import torch

from . import _validate as validate

__all__ = ["load", "flash_attention_triton", "compiled_registers", "UNAVAILABLE"]

UNAVAILABLE = ""   # why Triton cannot run here ("" when it can): set by load()

# Triton picks the interpreter when a jit function is defined, its own standard library included, so the
# variable must be set before triton is first imported (torch imports it too, e.g. for a TorchDispatchMode).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _imported_without_interpreter() -> bool:
    """Whether triton was imported (by torch, before this module) with compiled, not interpreted, builtins."""
    if "triton.language.standard" not in sys.modules or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    from triton.runtime.interpreter import InterpretedFunction
    return not isinstance(sys.modules["triton.language.standard"].max, InterpretedFunction)


def load() -> ModuleType | None:
    """This module with its kernel defined, or None where Triton does not import (its reason in UNAVAILABLE)."""
    global UNAVAILABLE
    try:
        if _imported_without_interpreter():    # a compiled extension cannot be imported twice
            UNAVAILABLE = ("Triton was imported before TRITON_INTERPRET=1 was set, so it cannot interpret kernels "
                           "on the CPU: import course_lib.flash_triton first, or start Python with TRITON_INTERPRET=1")
            return None
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError as exc:
        UNAVAILABLE = (f"Triton is not installed ({exc.name or exc}); it ships wheels for Linux only: "
                       f"pip install 'attention-course[triton]' there")
        return None
    except Exception as exc:  # a broken install: say so, never fail the notebook
        UNAVAILABLE = f"Triton does not import here: {type(exc).__name__}: {exc}"
        return None
    if os.environ.get("TRITON_INTERPRET") == "1" and not _interpreter_loops_to_an_argument():
        UNAVAILABLE = (f"the interpreter of Triton {triton.__version__} cannot run a loop whose bound is a kernel "
                       f"argument, as this kernel's is (Triton 3.9's can)")
        return None
    _define()
    UNAVAILABLE = ""
    return sys.modules[__name__]


@functools.cache
def _interpreter_loops_to_an_argument() -> bool:
    """Whether Triton's interpreter runs ``for i in range(0, n, 1)`` with ``n`` an argument. Triton 3.6's
    holds scalar arguments as one-element arrays, which NumPy 2.4 and 2.5 refuse to turn into a loop bound
    (seen with 3.6.0; 3.9.0 can)."""
    import triton
    import triton.language as tl

    @triton.jit
    def count_to(out_ptr, n):
        total = 0
        for _ in range(0, n, 1):
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count_to[(1,)](out, 3)
    except Exception:   # the interpreter's InterpreterError, whatever it wraps
        return False
    return int(out[0]) == 3


_kernel = None


def _define() -> None:
    global _kernel
    if _kernel is not None:
        return
    import triton
    import triton.language as tl

    @triton.jit
    def flash_forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, length, scale,
                             CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                             HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):
        """One program per (query block, head): q, k, v, out are (heads, length, HEAD_DIM), contiguous."""
        block, head = tl.program_id(0), tl.program_id(1)
        rows = block * BLOCK_Q + tl.arange(0, BLOCK_Q)                     # (BLOCK_Q,) query positions
        dims = tl.arange(0, HEAD_DIM)                                       # (HEAD_DIM,)
        base = head * length * HEAD_DIM
        q = tl.load(q_ptr + base + rows[:, None] * HEAD_DIM + dims[None, :], mask=rows[:, None] < length,
                    other=0.0)                                              # (BLOCK_Q, HEAD_DIM)
        m = tl.full((BLOCK_Q,), float("-inf"), tl.float32)                 # running maximum
        total = tl.zeros((BLOCK_Q,), tl.float32)                            # running sum
        acc = tl.zeros((BLOCK_Q, HEAD_DIM), tl.float32)                     # unnormalised output
        stop = tl.minimum(length, (block + 1) * BLOCK_Q) if CAUSAL else length
        for start in range(0, stop, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)                            # (BLOCK_K,) key positions
            k = tl.load(k_ptr + base + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < length,
                        other=0.0)                                          # (BLOCK_K, HEAD_DIM)
            v = tl.load(v_ptr + base + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < length,
                        other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale   # (BLOCK_Q, BLOCK_K)
            allowed = cols[None, :] < length                                # padded keys never count
            if CAUSAL:
                allowed = allowed & (cols[None, :] <= rows[:, None])
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            correction = tl.exp(m - m_new)
            total = total * correction + tl.sum(p, axis=1)
            acc = acc * correction[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m = m_new
        out = acc / total[:, None]
        tl.store(out_ptr + base + rows[:, None] * HEAD_DIM + dims[None, :], out, mask=rows[:, None] < length)
        tl.store(lse_ptr + head * length + rows, m + tl.log(total), mask=rows < length)

    _kernel = flash_forward_kernel


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_q: int = 16,
                           block_k: int = 16, causal: bool = False, precision: str = "ieee", num_warps: int = 4
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash.flash_attention`` for q, k, v (..., L, d) of one length, run by the Triton kernel: (out, lse).

    Block sizes and d must be powers of two of at least 16 (what ``tl.dot`` takes). On a GPU the kernel is
    compiled and q, k, v must be CUDA tensors. ``precision="ieee"`` multiplies in full float32, so the result
    equals ``flash.flash_attention`` within 1e-5; ``"tf32"`` lets the tensor cores round the products' inputs
    to 10 bits of mantissa (faster; about 1e-3 off, measured on an H200). ``num_warps``: the warps of each
    program on a GPU (Triton's default, 4, or 1 to 32; the interpreter ignores it). Full float32 tiles need
    many registers: on an H200, 64 x 64 tiles in 4 warps spilled 2,180 of them to memory in the causal kernel
    and took 67 ms at L = 4,096, against 3.5 ms in 8 warps (PERFORMANCE.md)."""
    if _kernel is None:
        raise RuntimeError(f"the Triton kernel is not defined: call flash_triton.load() first ({UNAVAILABLE})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        validate.tensor(name, t, min_dim=2, floating=True)
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"k, v: expected the shape of q {tuple(q.shape)}, got {tuple(k.shape)} and {tuple(v.shape)}")
    for name, n in (("block_q", block_q), ("block_k", block_k), ("head_dim", q.shape[-1])):
        if validate.positive_int(name, n) < 16 or n & (n - 1):
            raise ValueError(f"{name}: expected a power of two of at least 16 (tl.dot's smallest tile), got {n}")
    validate.one_of("precision", precision, ["ieee", "tf32"])
    if validate.positive_int("num_warps", num_warps) > 32 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps: expected a power of two from 1 to 32, got {num_warps}")
    compiled = os.environ.get("TRITON_INTERPRET") != "1"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != ("cuda" if compiled else "cpu"):
            raise ValueError(f"{name}: expected a {'CUDA' if compiled else 'CPU'} tensor (the kernel is "
                             f"{'compiled for the GPU' if compiled else 'interpreted on the CPU'} here), got one on "
                             f"{t.device}")
    length, head_dim = q.shape[-2], q.shape[-1]
    flat = [t.reshape(-1, length, head_dim).float().contiguous() for t in (q, k, v)]    # (heads, L, d)
    out = torch.empty_like(flat[0])
    lse = torch.empty(flat[0].shape[:-1], dtype=torch.float32, device=q.device)          # (heads, L)
    grid = (math.ceil(length / block_q), flat[0].shape[0])
    _kernel[grid](*flat, out, lse, length, 1.0 / math.sqrt(head_dim), CAUSAL=bool(causal), BLOCK_Q=block_q,
                  BLOCK_K=block_k, HEAD_DIM=head_dim, PRECISION=precision, num_warps=num_warps)
    return out.reshape(q.shape).to(q.dtype), lse.reshape(q.shape[:-1]).to(q.dtype)


def compiled_registers(head_dim: int, *, block_q: int, block_k: int, causal: bool = False, precision: str = "ieee",
                       num_warps: int = 4, device: str | torch.device = "cuda") -> tuple[int, int]:
    """(registers per thread, registers spilled to memory) of the kernel as compiled for these settings.

    Spills are what make a tile shape slow: each one is a trip to memory inside the inner loop. Needs a CUDA
    device, since the interpreter compiles nothing."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError(f"device: expected a CUDA device with the compiled kernel (the interpreter compiles "
                         f"nothing), got {device}")
    q = torch.zeros(1, block_q, head_dim, device=device)                 # one block of one head: compiling is all
    out, lse = torch.empty_like(q), torch.empty(1, block_q, device=device)
    flash_attention_triton(q, q, q, block_q=block_q, block_k=block_k, causal=causal, precision=precision,
                           num_warps=num_warps)                            # checks the settings, as a call would
    handle = _kernel[(1, 1)](q, q, q, out, lse, block_q, 1.0, CAUSAL=bool(causal), BLOCK_Q=block_q, BLOCK_K=block_k,
                             HEAD_DIM=head_dim, PRECISION=precision, num_warps=num_warps)
    return int(handle.n_regs), int(handle.n_spills)
