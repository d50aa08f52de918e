"""RoPE written once with the classic student mistakes switchable on (exercises 9.1, 9.2 and 9.6).

The checkers compute what a mistake would give on the same inputs and name the mistake whose output
the student's matches. Everything here runs in float64, so a match is never a matter of rounding.
"""
from __future__ import annotations

import math

import torch

# ---------------------------------------------------------------- the tables (9.1)

# The exponent of theta for pair i of head_dim d, right ("2i/d") and as students slip.
_EXPONENTS = {
    "2i/d": lambda i, d: 2 * i / d,
    "i/d": lambda i, d: i / d,                        # the pair index where the dimension index 2i belongs
    "4i/d": lambda i, d: 4 * i / d,                   # stepping 0, 2, 4, ... and doubling again
    "2i/(d-1)": lambda i, d: 2 * i / max(d - 1, 1),   # dividing by d - 1
    "-2i/d": lambda i, d: -2 * i / d,                 # theta ** (+2i/d): frequencies that grow
}


def frequencies(head_dim: int, theta: float, *, exponent: str = "2i/d", base: float | None = None) -> torch.Tensor:
    """The turn per position of each pair, (head_dim // 2,): base ** -exponent (base = theta when right)."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    return float(theta if base is None else base) ** -_EXPONENTS[exponent](i, head_dim)


def tables(head_dim: int, max_tokens: int, theta: float, *, exponent: str = "2i/d", base: float | None = None,
           layout: str = "half", first_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (max_tokens, head_dim) in float64. layout "half" repeats the head_dim/2 angles
    as two halves (right); "interleaved" repeats each angle twice in a row."""
    positions = torch.arange(max_tokens, dtype=torch.float64) + first_position             # (T,)
    angles = torch.outer(positions, frequencies(head_dim, theta, exponent=exponent, base=base))   # (T, d/2)
    if layout == "half":
        angles = torch.cat([angles, angles], dim=-1)                                        # (T, d)
    else:
        angles = angles.repeat_interleave(2, dim=-1)                                        # (T, d)
    return angles.cos(), angles.sin()


def table_mistakes(theta: float) -> list[tuple[str, str, dict]]:
    """(code, what went wrong, tables() keywords) for the slips students make in rope_tables."""
    default = theta == 10000.0
    found = [
        ("rope_layout", "the angles are repeated element by element (repeat_interleave, or stacking and "
                        "flattening), which pairs dimensions (2i, 2i+1). This course (like Hugging Face "
                        "Llama) pairs dimension i with i + head_dim/2: concatenate the head_dim/2 angles with "
                        "themselves, torch.cat([angles, angles], dim=-1)", {"layout": "interleaved"}),
        ("rope_frequencies", "the exponent uses the pair index i over head_dim; it should be 2i/head_dim "
                             "(step through 0, 2, 4, ... or multiply i by 2)", {"exponent": "i/d"}),
        ("rope_frequencies", "the exponent counts the dimension index twice: you step through 0, 2, 4, ... "
                             "and multiply by 2 again", {"exponent": "4i/d"}),
        ("rope_frequencies", "the frequencies grow with the dimension instead of shrinking: pair i turns by "
                             "theta^(-2i/head_dim) per position, so divide by theta^(2i/head_dim), do not multiply",
         {"exponent": "-2i/d"}),
        ("rope_frequencies", "the exponent divides by head_dim - 1; it should divide by head_dim",
         {"exponent": "2i/(d-1)"}),
        ("rope_frequencies", "the base is e: with exp(), the exponent needs the factor log(theta)",
         {"base": math.e}),
        ("rope_positions", "your positions start at 1. Row 0 is position 0, which is not turned at all "
                           "(cos = 1, sin = 0)", {"first_position": 1}),
    ]
    if not default:
        found.insert(1, ("rope_frequencies", f"you ignore `theta`: these are the tables of theta=10000, "
                                             f"but theta={theta:g} was asked for. Use the argument as the base",
                         {"base": 10000.0}))
    for base in (1000.0, 100.0, 500000.0):
        if base != theta:
            found.append(("rope_frequencies", f"the base is {base:g} whatever `theta` says; use theta "
                                              f"(here {theta:g})", {"base": base}))
    return found


# ---------------------------------------------------------------- the rotation (9.2, 9.6)

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The quarter turn of interleaved pairs (2i, 2i+1): [x0, x1, x2, x3] -> [-x1, x0, -x3, x2]."""
    return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int, *, kind: str = "half",
           axis: str = "length") -> torch.Tensor:
    """x (N, heads, L, head_dim) turned to positions offset.., with the mistake ``kind`` (and ``axis``).

    kind: "half" (right), "reverse" (the other way), "swapped" (sin and cos swapped), "no_rotate_half"
    (x * sin instead of rotate_half(x) * sin), "pairs_table" (interleaved pairs with the half-split tables
    as they are), "pairs" (interleaved pairs with their own angles, GPT-J / Meta's Llama code),
    "first_half" / "second_half" (only that half of the last axis turned, the other passed through).
    axis: "length" (right) or "heads" (positions read along the head axis, as for (N, L, heads, head_dim)).
    """
    x = x.double()
    rows = x.shape[-2] if axis == "length" else x.shape[1]
    c, s = cos[offset:offset + rows].double(), sin[offset:offset + rows].double()   # (rows, head_dim)
    if axis == "heads":
        c, s = c[:, None, :], s[:, None, :]                                         # (heads, 1, head_dim)
    if kind == "pairs":
        half = x.shape[-1] // 2
        c, s = c[..., :half].repeat_interleave(2, dim=-1), s[..., :half].repeat_interleave(2, dim=-1)
    turned = {"half": rotate_half, "reverse": lambda t: -rotate_half(t), "no_rotate_half": lambda t: t,
              "pairs_table": rotate_pairs, "pairs": rotate_pairs}
    if kind == "swapped":
        return x * s + rotate_half(x) * c
    if kind in ("first_half", "second_half"):
        half = x.shape[-1] // 2
        full = x * c + rotate_half(x) * s
        keep = slice(half, None) if kind == "first_half" else slice(None, half)
        full[..., keep] = x[..., keep]
        return full
    return x * c + turned[kind](x) * s


def rotate_flat(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int, heads: int) -> torch.Tensor:
    """The mistake of turning the flat projection (N, L, heads * head_dim) with the tables tiled across the
    heads: rotate_half then swaps the halves of ALL features, mixing the heads."""
    x = x.double()
    length = x.shape[-2]
    c = cos[offset:offset + length].double().repeat(1, heads)                   # (L, heads * head_dim)
    s = sin[offset:offset + length].double().repeat(1, heads)
    return x * c + rotate_half(x) * s
