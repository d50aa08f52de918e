"""The training loop's optimisers: AdamW for everything, or Muon for the blocks' matrices.

Muon (Jordan et al., 2024; :class:`course_lib.muon.Muon`) orthogonalises each weight matrix's momentum
with a few Newton-Schulz iterations before the step, so every direction of the matrix moves at
the same rate. It only makes sense for the 2-D weights inside the transformer blocks; the token
embedding, the output head and the norms' gains keep AdamW. In the speed runs of 2024-25 it
reaches a given loss in fewer steps than AdamW; on the course's CPU recipe it buys more than its
extra cost per step (PERFORMANCE.md, "what each change bought").
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .muon import Muon

__all__ = ["build_optimizer", "MuonWithAdamW", "hidden_matrices"]


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights inside ``model.blocks``: the projections of attention and feed-forward."""
    if not isinstance(getattr(model, "blocks", None), nn.ModuleList):
        raise TypeError(f"model: expected a model with its transformer blocks in .blocks (GPT, ModernGPT), "
                        f"got {type(model).__name__}")
    return [p for p in model.blocks.parameters() if p.requires_grad and p.dim() == 2]


def _adamw(params: list[nn.Parameter], lr: float, weight_decay: float, betas: tuple[float, float],
           device_type: str) -> torch.optim.AdamW:
    # Decay matrices and embeddings, not biases and norm gains (as GPT-2 and nanoGPT do). The fused
    # kernel updates every weight in one pass instead of one small op per tensor and step.
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas,
                             fused=device_type in ("cuda", "cpu"))


class MuonWithAdamW:
    """Muon for :func:`hidden_matrices`, AdamW for every other parameter, stepped together.

    The training loop sets one learning rate per step; each group's ``lr_scale`` turns it into that
    group's own (``muon_learning_rate / learning_rate`` for Muon's groups, 1 for AdamW's), so both
    follow the same warmup and decay. ``state_dict`` holds both, for checkpoints and ``--resume``.
    """

    def __init__(self, model: nn.Module, *, learning_rate: float, muon_learning_rate: float,
                 muon_momentum: float, weight_decay: float, betas: tuple[float, float], device_type: str):
        hidden = hidden_matrices(model)
        hidden_ids = {id(p) for p in hidden}
        others = [p for p in {id(p): p for p in model.parameters()}.values()
                  if p.requires_grad and id(p) not in hidden_ids]
        self.muon = Muon(hidden, lr=muon_learning_rate, weight_decay=weight_decay, momentum=muon_momentum)
        self.adamw = _adamw(others, learning_rate, weight_decay, betas, device_type)
        for group in self.muon.param_groups:
            group["lr_scale"] = muon_learning_rate / learning_rate
        for group in self.adamw.param_groups:
            group["lr_scale"] = 1.0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != {"muon", "adamw"}:
            raise ValueError("state: expected the state of a Muon + AdamW optimiser (keys 'muon' and 'adamw'), "
                             f"got keys {sorted(state) if isinstance(state, dict) else type(state).__name__}; "
                             f"was the checkpoint written with optimizer='adamw'?")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def build_optimizer(model: nn.Module, config: Any, device_type: str) -> torch.optim.AdamW | MuonWithAdamW:
    """The optimiser ``config`` (a :class:`course_lib.train.TrainConfig`) asks for."""
    betas = (config.beta1, config.beta2)
    if config.optimizer == "muon":
        return MuonWithAdamW(model, learning_rate=config.learning_rate,
                             muon_learning_rate=config.muon_learning_rate, muon_momentum=config.muon_momentum,
                             weight_decay=config.weight_decay, betas=betas, device_type=device_type)
    params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    return _adamw(params, config.learning_rate, config.weight_decay, betas, device_type)
