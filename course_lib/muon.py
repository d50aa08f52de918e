r"""Muon: SGD with momentum whose update matrix is orthogonalised first (Jordan et al., 2024).

For a weight matrix :math:`W` with gradient :math:`G`, one step is

.. math::
    M \leftarrow \mu M + (1-\mu) G, \qquad
    U = \mathrm{orthogonalize}\big(\mu M + (1-\mu) G\big) \;\text{(Nesterov)}, \qquad
    W \leftarrow (1 - \eta\lambda) W - \eta \sqrt{\max(1, \text{rows}/\text{cols})}\; U

where :func:`orthogonalize` turns :math:`U S V^\top` into roughly :math:`U V^\top`: every direction of the
matrix moves at the same rate, however lopsided the gradient's singular values are. The update rule, the
learning-rate scale and the state's names are ``torch.optim.Muon``'s, so a checkpoint written with either loads
into the other. Ours differs in one thing: the Newton-Schulz iterations run in bfloat16 only on a GPU. On a
CPU without native bfloat16 matrix units (AVX2 chips, most laptops) torch emulates bfloat16 matmuls, about 25
times slower than float32: ``torch.optim.Muon`` then spent 1.36 s a step on the course's CPU recipe, where
float32 takes 45 ms (PERFORMANCE.md).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from . import _validate as validate

__all__ = ["NS_COEFFICIENTS", "orthogonalize", "Muon"]

# The quintic of Jordan et al.: as steep as possible at 0, so small singular values grow fast. It leaves them
# between about 0.7 and 1.2 rather than exactly 1, which trains as well (and takes 5 steps, not 10+).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(update: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    r"""Push every singular value of ``update`` (rows, cols), or of each matrix of a batch, towards 1.

    Newton-Schulz: after scaling so that every singular value is at most 1, repeat
    :math:`X \leftarrow aX + (bXX^\top + c(XX^\top)^2)X`, which maps each singular value :math:`s` to
    :math:`as + bs^3 + cs^5` and leaves the singular vectors alone. Runs in ``dtype``; returns ``update``'s.
    """
    validate.tensor("update", update, min_dim=2)
    validate.positive_int("steps", steps)
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype).reshape(-1, *update.shape[-2:])            # (matrices, rows, cols)
    tall = x.shape[-2] > x.shape[-1]
    if tall:   # work on the wide side: X X^T is then the smaller Gram matrix
        x = x.mT                                                     # (matrices, cols, rows)
    # the Frobenius norm bounds the largest singular value: after this every one is at most 1
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.mT                                              # (matrices, short, short)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)      # b G + c G G, one call
        x = torch.baddbmm(x, poly, x, beta=a)                        # a X + (b G + c G G) X
    if tall:
        x = x.mT                                                     # (matrices, rows, cols)
    x = x.reshape(update.shape)
    return x.to(update.dtype)


class Muon(torch.optim.Optimizer):
    """Muon for 2-D weights: ``lr``, ``momentum``, decoupled ``weight_decay``, Nesterov, ``ns_steps`` iterations.

    Defaults are ``torch.optim.Muon``'s. The iterations run in bfloat16 on a GPU and in float32 elsewhere.
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5):
        validate.positive_float("lr", lr, finite=True)
        validate.finite_number("weight_decay", weight_decay, minimum=0.0)
        validate.number_in("momentum", momentum, low=0.0, high=1.0, high_open=True)
        validate.boolean("nesterov", nesterov)
        validate.positive_int("ns_steps", ns_steps)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_steps=ns_steps))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"params: Muon orthogonalises matrices, so it takes 2-D weights only; got "
                                     f"one of shape {tuple(p.shape)} (give vectors, norms and embeddings to AdamW)")

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError("closure: Muon takes no closure (compute the loss and call backward() first), "
                             f"got {validate.describe(closure)}")
        for group in self.param_groups:
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            # Matrices of one shape, device and dtype (a tall one counted by its wide side) are orthogonalised
            # in one batch: on the course's CPU recipe that is 2 batches instead of 14 matrices. Measured with the
            # 12 matrices it had with ReLU², the optimiser's share of a step fell from 22 ms to 9.7 ms
            # (PERFORMANCE.md). Each matrix's result is the one it gets alone.
            batches: dict[tuple[Any, ...], list[tuple[nn.Parameter, torch.Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(p.grad, 1 - momentum)                   # M = mu M + (1 - mu) G
                update = p.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                wide = update.mT if update.shape[0] > update.shape[1] else update   # (short, long)
                batches.setdefault((*wide.shape, wide.device, wide.dtype), []).append((p, wide))
            for pairs in batches.values():
                # bfloat16 where a GPU's tensor cores run it; emulated, and slow, on most CPUs
                dtype = torch.bfloat16 if pairs[0][0].is_cuda else torch.float32
                updates = orthogonalize(torch.stack([wide for _, wide in pairs]), group["ns_steps"], dtype)
                for (p, _), update in zip(pairs, updates):               # update: (short, long)
                    if p.shape != update.shape:
                        update = update.mT                               # (rows, cols) again
                    p.mul_(1 - lr * decay)
                    # as torch.optim.Muon: a tall matrix's orthonormal columns have entries of 1/sqrt(rows);
                    # sqrt(rows/cols) makes them 1/sqrt(cols), as large as a wide matrix's
                    p.add_(update, alpha=-lr * math.sqrt(max(1.0, p.shape[0] / p.shape[1])))
