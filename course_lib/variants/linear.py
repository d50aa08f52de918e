r"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"): attention as a recurrence.

Softmax attention weighs value ``j`` by :math:`\exp(q_i \cdot k_j)`. Replace that by
:math:`\phi(q_i) \cdot \phi(k_j)` for a feature map :math:`\phi` with positive outputs, here
:math:`\phi(x) = \mathrm{elu}(x) + 1`, and the causal output becomes

.. math:: o_i = \frac{\phi(q_i)^\top \sum_{j \le i} \phi(k_j) v_j^\top}{\phi(q_i)^\top \sum_{j \le i} \phi(k_j)}
              = \frac{\phi(q_i)^\top S_i}{\phi(q_i)^\top z_i}.

The sums :math:`S_i` (a ``d x d_v`` matrix) and :math:`z_i` (a ``d`` vector, the normaliser) grow by one
term per token, so generation keeps a state of fixed size instead of a KV cache that grows.

Cost, for L tokens and head size d: the parallel form builds the (L, L) matrix of
:math:`\phi(q_i) \cdot \phi(k_j)` like softmax attention, O(L^2 d) time and O(L^2) memory; the recurrent
form does one O(d^2) update and one O(d^2) read per token, O(L d^2) time and O(d^2) memory. The recurrence
wins once L is larger than d.

Token ``i`` sees itself (the mask includes the diagonal), so the recurrence adds token ``i``'s key and
value to the state *first*, then reads it with query ``i``.
"""
from __future__ import annotations

import torch

from .. import _validate as validate

__all__ = ["elu_feature_map", "linear_attention", "linear_attention_recurrent"]


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1, that is x + 1 above zero and exp(x) below: positive, so every weight is > 0.

    Written as exp(x) below zero rather than ``F.elu(x) + 1``, whose (exp(x) - 1) + 1 rounds to exactly 0 in
    float32 once x < -17; the same function, positive down to x = -87.
    """
    validate.tensor("x", x, floating=True)
    # clamp: the branch torch.where discards still gets a gradient, and exp of a large x would make it inf * 0
    return torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)))


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    validate.tensor("q", q, min_dim=2, floating=True)
    validate.tensor("k", k, min_dim=2, floating=True)
    validate.tensor("v", v, min_dim=2, floating=True)
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q {tuple(q.shape)} (..., L, d), got {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v: expected shape {tuple(q.shape[:-1])} + (d_v,), one value per key, got {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, other in (("k", k), ("v", v)):
        if other.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} (the device of q), got {other.device}")


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """The parallel form: q, k (..., L, d), v (..., L, d_v) -> (..., L, d_v). O(L^2 d) time.

    Weights ``phi(q_i) . phi(k_j)`` for ``j <= i`` (all j if not ``causal``), each row divided by its sum
    (plus ``eps``, which keeps a row whose features all underflow to 0 finite).
    """
    _check_qkv(q, k, v)
    validate.boolean("causal", causal)
    eps = validate.finite_number("eps", eps, minimum=0.0)
    fq, fk = elu_feature_map(q), elu_feature_map(k)    # (..., L, d), positive
    scores = fq @ fk.transpose(-2, -1)                  # (..., L, L)
    if causal:
        length = q.shape[-2]
        scores = scores * torch.ones(length, length, dtype=torch.bool, device=q.device).tril()   # zero, not -inf
    return (scores @ v) / (scores.sum(dim=-1, keepdim=True) + eps)   # (..., L, d_v)


def linear_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               state: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                               eps: float = 1e-6) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The recurrent form, one token at a time: returns the outputs (..., L, d_v) and the state (S, z).

    ``S`` (..., d, d_v) is the sum of ``phi(k_j) v_j^T`` and ``z`` (..., d) the sum of ``phi(k_j)`` over
    the tokens seen; pass ``state`` back to continue the same sequences. O(L d^2) time, O(d^2) memory.
    """
    _check_qkv(q, k, v)
    eps = validate.finite_number("eps", eps, minimum=0.0)
    *batch, length, d = q.shape
    d_v = v.shape[-1]
    if state is None:
        s = q.new_zeros(*batch, d, d_v)   # (..., d, d_v)
        z = q.new_zeros(*batch, d)        # (..., d)
    else:
        if not isinstance(state, tuple) or len(state) != 2:
            raise TypeError(f"state: expected None or the (S, z) pair this function returned, got {validate.describe(state)}")
        s, z = state
        validate.tensor("state[0]", s, floating=True)
        validate.tensor("state[1]", z, floating=True)
        if s.shape != (*batch, d, d_v) or z.shape != (*batch, d):
            raise ValueError(f"state: expected S {(*batch, d, d_v)} and z {(*batch, d)} for these q, v, got "
                             f"{tuple(s.shape)} and {tuple(z.shape)}")
        if s.dtype != q.dtype or z.dtype != q.dtype:
            raise TypeError(f"state: expected S and z in q's dtype {q.dtype}, got {s.dtype} and {z.dtype}")
        if s.device != q.device or z.device != q.device:
            raise ValueError(f"state: expected S and z on q's device {q.device}, got {s.device} and {z.device}")
    fq, fk = elu_feature_map(q), elu_feature_map(k)   # (..., L, d)
    outputs = []
    for i in range(length):
        # 1. add token i to the state first: query i sees its own key (the causal mask includes j = i)
        s = s + fk[..., i, :, None] * v[..., i, None, :]       # (..., d, d_v), outer product phi(k_i) v_i^T
        z = z + fk[..., i, :]                                   # (..., d)
        # 2. then read it with query i, and normalise
        numerator = (fq[..., i, None, :] @ s).squeeze(-2)       # (..., d_v)
        denominator = (fq[..., i, :] * z).sum(-1, keepdim=True)   # (..., 1)
        outputs.append(numerator / (denominator + eps))
    if not outputs:   # no tokens: nothing to output, the state unchanged
        return v.new_zeros(*batch, 0, d_v), (s, z)
    return torch.stack(outputs, dim=-2), (s, z)                # (..., L, d_v)
