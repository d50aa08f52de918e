"""Checker for notebook 04's sinusoidal position table: which way the table went wrong."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ._core import call, checker, expect_tensor, fail, register
from ._model_common import as_tensor, close

__all__ = ["check_sinusoidal_table"]


# ---------------------------------------------------------------- 4.1 sinusoidal_table

def _table(max_tokens: int, embed_dim: int, *, frequency: torch.Tensor | None = None, first: str = "sin",
           layout: str = "interleave", offset: int = 0) -> torch.Tensor:
    """A family of tables: the reference and the ways students get it wrong."""
    half = embed_dim // 2
    if frequency is None:
        frequency = 10000.0 ** (-torch.arange(0, embed_dim, 2, dtype=torch.float64)[:half] / embed_dim)
    angles = (torch.arange(max_tokens, dtype=torch.float64)[:, None] + offset) * frequency   # (T, d/2)
    a, b = (angles.sin(), angles.cos()) if first == "sin" else (angles.cos(), angles.sin())
    if layout == "interleave":
        return torch.stack([a, b], dim=-1).flatten(1)   # (T, d): a b a b ...
    return torch.cat([a, b], dim=-1)                    # (T, d): a a ... b b ...


def _frequency_variants(embed_dim: int) -> list[tuple[torch.Tensor, str]]:
    pair = torch.arange(embed_dim // 2, dtype=torch.float64)   # i = 0, 1, ...
    even = 2 * pair                                             # 2i = 0, 2, ...
    return [
        (10000.0 ** (-pair / embed_dim),
         "the exponent uses the pair index i over embed_dim; it should be the even dimension index 2i over "
         "embed_dim (i.e. step through 0, 2, 4, ... or multiply i by 2)"),
        (10000.0 ** (-2 * even / embed_dim),
         "the exponent counts the dimension index twice: you step through the even indices (0, 2, 4, ...) and "
         "then multiply by 2 again"),
        (10000.0 ** (even / embed_dim),
         "the frequencies grow with the dimension instead of shrinking: you multiply the position by "
         "10000^(2i/d) where you should divide by it"),
        (1000.0 ** (-even / embed_dim), "the base is 1000; the paper uses 10000"),
        (100.0 ** (-even / embed_dim), "the base is 100; the paper uses 10000"),
        (math.e ** (-even / embed_dim),
         "the base is e: if you write it with exp(), remember the factor log(10000)"),
        (10000.0 ** (-even / (embed_dim - 1 if embed_dim > 1 else 1)),
         "the exponent divides by embed_dim - 1; it should divide by embed_dim"),
    ]


def _diagnose_table(got: torch.Tensor, max_tokens: int, embed_dim: int, what: str) -> None:
    got = got.double()
    if close(got, _table(max_tokens, embed_dim, first="cos")):
        fail("mismatch", f"{what}: sine and cosine are swapped. Even dimensions (0, 2, 4, ...) hold the sines "
                         f"and odd dimensions the cosines, so row 0 (position 0) should read 0, 1, 0, 1, ...")
    for first, second in (("sines", "cosines"), ("cosines", "sines")):
        if close(got, _table(max_tokens, embed_dim, layout="concat", first=first[:3])):
            fail("mismatch", f"{what}: you concatenated the halves: all the {first} first, then all the "
                             f"{second}. The table interleaves them: dimension 2i "
                             f"is the sine and dimension 2i+1 the cosine of the same angle. Fill the even and "
                             f"odd columns separately, or stack the two along a new last dimension and flatten.")
    if close(got, _table(max_tokens, embed_dim, offset=1)):
        fail("mismatch", f"{what}: your positions start at 1. Row 0 is position 0 (sin 0 = 0, cos 0 = 1).")
    for frequency, why in _frequency_variants(embed_dim):
        for layout in ("interleave", "concat"):
            if close(got, _table(max_tokens, embed_dim, frequency=frequency, layout=layout)):
                extra = "" if layout == "interleave" else " (and the sines and cosines should interleave)"
                fail("scale", f"{what}: the wavelengths are wrong: {why}{extra}.")
    # sin and cos of one angle per pair, starting at angle 0, but other angles: the frequencies are off
    if embed_dim >= 2 and max_tokens >= 2:
        even, odd = got[:, 0:2 * (embed_dim // 2):2], got[:, 1:2 * (embed_dim // 2):2]
        on_circle = torch.allclose(even ** 2 + odd ** 2, torch.ones_like(even), atol=1e-3)
        starts_at_zero = torch.allclose(even[0], torch.zeros_like(even[0]), atol=1e-4)
        if on_circle and starts_at_zero:
            fail("scale", f"{what}: every pair of dimensions holds the sine and cosine of one angle, but the "
                          f"angles are wrong: dimension pair i should turn at the rate 1 / 10000^(2i/embed_dim) "
                          f"per position. Check the base, the exponent and that you divide the position by it.")
    diff = (got - _table(max_tokens, embed_dim)).abs()
    pos, dim = divmod(int(diff.argmax()), embed_dim)
    fail("mismatch", f"{what}: values differ from the reference, first at position {pos}, dimension {dim} "
                     f"(got {got[pos, dim]:.4f}, expected {_table(max_tokens, embed_dim)[pos, dim]:.4f}). "
                     f"Even dimension 2i holds sin(pos / 10000^(2i/d)), odd dimension 2i+1 the cosine.")


@checker("4.1")
def check_sinusoidal_table(fn: Callable[..., Any]) -> str:
    """fn(max_tokens, embed_dim) -> (max_tokens, embed_dim), as ``course_lib.model.sinusoidal_table``."""
    from course_lib.model import sinusoidal_table as reference

    for max_tokens, embed_dim in ((12, 8), (5, 6), (1, 4), (40, 16)):
        what = f"sinusoidal_table({max_tokens}, {embed_dim})"
        got = as_tensor(call(fn, max_tokens, embed_dim, what=what))
        if (isinstance(got, torch.Tensor) and tuple(got.shape) == (embed_dim, max_tokens)
                and max_tokens != embed_dim):
            fail("shape", f"{what} returned shape {tuple(got.shape)}: one row per dimension. The table has one "
                          f"row per position, (max_tokens, embed_dim): positions should run down the rows "
                          f"(a column of positions) and frequencies across the columns (a row of frequencies).")
        expect_tensor(got, (max_tokens, embed_dim), what)
        if not got.is_floating_point():
            fail("dtype", f"{what} returned dtype {got.dtype}; sines and cosines need a float tensor "
                          f"(start from torch.arange(..., dtype=torch.float32)).")
        if not close(got, reference(max_tokens, embed_dim)):
            _diagnose_table(got, max_tokens, embed_dim, what)
    return "Sines on the even dimensions, cosines on the odd ones, wavelengths from 2π to 10000·2π."


register("4.1", "sinusoidal_table", [
    "Build a column of positions (max_tokens, 1) and a row of frequencies (1, embed_dim // 2); their product "
    "is every angle at once, by broadcasting.",
    "Frequency of pair i: 1 / 10000^(2i / embed_dim). Computing it as exp(2i * -log(10000) / embed_dim) is the "
    "same number and numerically kinder.",
    "Start from torch.zeros(max_tokens, embed_dim) and fill the even columns (0::2) with the sines and the odd "
    "columns (1::2) with the cosines of the same angles.",
], solution="course_lib.model:sinusoidal_table")
