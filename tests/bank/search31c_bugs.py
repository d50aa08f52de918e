"""Attempts of the thirty-first search's classes on 6.1 (FLOPs per token) and 9.3 (RMSNorm); 8.1's option is in
tests/test_check_options.py (a wrong option is refused before any verdict).

6.1 mutation: a count that changes the caller's config (halves the context and doubles it back, counts the layers
down to zero, stores its result on it) is ``mutation`` even when the number is right: every field of the config
is compared before and after each call. Right counts that change a copy (dataclasses.replace, copy.copy) or put
back what they changed pass.

6.1 dtype: a count in 32-bit integers (np.int32, torch.int32, an int32 array) is right on small configurations
and wraps around on GPT-2 XL's count (N about 1.6e9, given with a small config): ``dtype``, the overflow named. Counts in
int64, float64 and float32 (off by its rounding only) pass.

9.3 mutation: a forward that changes self.weight in place (a clamp_ under no_grad, abs_, a rescale of .data) is
``mutation``, not ``kept_state``: the weight is compared before and after every forward, and one probe holds a
weight with negative entries, a zero and large values.

9.3 norm_statistic: the sum of the squares divided by another axis's length (x.shape[1], x.shape[-2]), or one mean
over several axes (every axis but the batch, the last two) names the axis. 9.3 epsilon: x divided by a size of its
own first (its max, its norm), which turns eps into eps·size², is ``epsilon``. Right RMSNorms written with rsqrt,
F.rms_norm, a rescale that scales eps along, a forward that records its statistic on the module, beside them.
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import new_bank

BUGGY, CORRECT, bug, correct = new_bank()


def _attention(config):
    return 12 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens


# ============================================================================ 6.1 the caller's config changed


@bug("6.1", "mutation", "config", "max_tokens", "do not change the config")
def flops_halves_the_context_on_the_config(config, num_weights):
    """Halves the context on the config for the causal mask, then doubles it back in the formula (r31)."""
    config.max_tokens = config.max_tokens // 2
    return 6 * num_weights + 12 * config.num_layers * config.num_heads * config.head_dim * (2 * config.max_tokens)


@bug("6.1", "mutation", "config.num_layers", "do not change the config")
def flops_counts_the_layers_down_on_the_config(config, num_weights):
    """One layer at a time, counted down on the config itself: the caller's config ends with 0 layers."""
    total = 6 * num_weights
    while config.num_layers:
        total += 12 * config.num_heads * config.head_dim * config.max_tokens
        config.num_layers -= 1
    return total


@bug("6.1", "mutation", "config.flops", "do not change the config")
def flops_stored_on_the_config(config, num_weights):
    """Writes its result onto the config (a new field), then returns it."""
    config.flops = 6 * num_weights + _attention(config)
    return config.flops


@correct("6.1")
def flops_changes_a_replaced_copy(config, num_weights):
    """Counts one layer on a copy made with dataclasses.replace, then multiplies by the caller's layers."""
    one = dataclasses.replace(config, num_layers=1)
    return 6 * num_weights + config.num_layers * _attention(one)


@correct("6.1")
def flops_changes_a_shallow_copy(config, num_weights):
    mine = copy.copy(config)
    mine.max_tokens = mine.max_tokens * 2
    return 6 * num_weights + _attention(mine) // 2


@correct("6.1")
def flops_puts_back_what_it_changed(config, num_weights):
    """Changes the context for a moment and puts it back before returning: the caller's config is as it was."""
    context = config.max_tokens
    try:
        config.max_tokens = 1
        per_key = _attention(config)
    finally:
        config.max_tokens = context
    return 6 * num_weights + per_key * context


# ============================================================================ 6.1 32-bit integers


@bug("6.1", "dtype", "int32", "overflow")
def flops_in_int32(config, num_weights):
    """numpy int32: overflows for a large model (r31)."""
    n = np.int32(num_weights)
    return int(np.int32(6) * n + np.int32(12) * np.int32(config.num_layers) * np.int32(config.num_heads)
               * np.int32(config.head_dim) * np.int32(config.max_tokens))


@bug("6.1", "dtype", "int32", "overflow")
def flops_in_a_torch_int32_tensor(config, num_weights):
    sizes = torch.tensor([config.num_layers, config.num_heads, config.head_dim, config.max_tokens], dtype=torch.int32)
    return torch.tensor(num_weights, dtype=torch.int32) * 6 + 12 * sizes.prod(dtype=torch.int32)


@bug("6.1", "dtype", "int32", "python int")
def flops_weights_term_in_int32(config, num_weights):
    """The sizes in an int32 array: the product is promoted to int64, but 6N is taken in int32 and wraps."""
    sizes = np.array([num_weights, config.num_layers, config.num_heads, config.head_dim, config.max_tokens],
                     dtype=np.int32)
    return 6 * sizes[0] + 12 * sizes[1:].prod()


@correct("6.1")
def flops_in_int64_numpy(config, num_weights):
    sizes = np.array([config.num_layers, config.num_heads, config.head_dim, config.max_tokens], dtype=np.int64)
    return np.int64(6) * np.int64(num_weights) + np.int64(12) * sizes.prod()


@correct("6.1")
def flops_in_float64_tensor(config, num_weights):
    return torch.tensor(6.0 * num_weights, dtype=torch.float64) + float(_attention(config))


@correct("6.1")
def flops_in_float32_tensor(config, num_weights):
    """A float32 tensor: 6N rounded to 24 bits for a large model, a few parts in 1e8 (r31 counted it right)."""
    return torch.tensor(6.0 * num_weights, dtype=torch.float32) + _attention(config)


# ============================================================================ 9.3 RMSNorm


class _NormBase(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))


def _normed(x, eps, mean_square):
    return x * torch.rsqrt(mean_square + eps)


@bug("9.3", "mutation", "self.weight", "in place")
class RMSNormClampsTheWeightInPlace(_NormBase):
    """Keeps the weight positive by clamping it in place at every forward (r31)."""
    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(min=0.0)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


@bug("9.3", "mutation", "self.weight", "in place")
class RMSNormTakesTheWeightsAbsInPlace(_NormBase):
    """`.data.abs_()`: a negative weight made positive, on the layer itself."""
    def forward(self, x):
        self.weight.data.abs_()
        xf = x.float()
        return (_normed(xf, self.eps, xf.pow(2).mean(-1, keepdim=True)) * self.weight).to(x.dtype)


@bug("9.3", "mutation", "self.weight", "in place")
class RMSNormRescalesTheWeightData(_NormBase):
    """Keeps the weight at most 4 by assigning .data at every forward."""
    def forward(self, x):
        self.weight.data = self.weight.data.clamp(max=4.0)
        xf = x.float()
        return (_normed(xf, self.eps, xf.pow(2).mean(-1, keepdim=True)) * self.weight).to(x.dtype)


@bug("9.3", "norm_statistic", "x.shape[1]", "dim", "last axis")
class RMSNormDividesByTheSecondAxis(_NormBase):
    """sum over the last axis, divided by x.shape[1] (the length, not dim) (r31)."""
    def forward(self, x):
        xf = x.float()
        ms = xf.pow(2).sum(-1, keepdim=True) / x.shape[1]
        return (xf * torch.rsqrt(ms + self.eps) * self.weight).to(x.dtype)


@bug("9.3", "norm_statistic", "x.shape[-2]", "dim", "last axis")
class RMSNormDividesByTheLength(_NormBase):
    def forward(self, x):
        xf = x.float()
        return (_normed(xf, self.eps, xf.pow(2).sum(-1, keepdim=True) / x.shape[-2]) * self.weight).to(x.dtype)


@bug("9.3", "norm_statistic", "every axis but the batch", "last axis only")
class RMSNormOverTheLastTwoAxes(_NormBase):
    """Mean over the tokens and the features together (r31)."""
    def forward(self, x):
        xf = x.float()
        ms = xf.pow(2).mean(dim=tuple(range(1, x.dim())), keepdim=True)
        return (xf * torch.rsqrt(ms + self.eps) * self.weight).to(x.dtype)


@bug("9.3", "norm_statistic", "(-2, -1)", "last axis only")
class RMSNormOverTokensAndFeatures(_NormBase):
    def forward(self, x):
        xf = x.float()
        return (_normed(xf, self.eps, xf.pow(2).mean(dim=(-2, -1), keepdim=True)) * self.weight).to(x.dtype)


@bug("9.3", "epsilon", "eps", "largest absolute value")
class RMSNormUnstableMaxScaled(_NormBase):
    """Divides by the max first 'for stability', then forgets the max in eps (r31)."""
    def forward(self, x):
        xf = x.float()
        m = xf.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        y = xf / m
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


@bug("9.3", "epsilon", "eps", "norm")
class RMSNormScaledByTheNormFirst(_NormBase):
    def forward(self, x):
        xf = x.float()
        y = xf / torch.linalg.vector_norm(xf, dim=-1, keepdim=True).clamp_min(1e-30)
        return (_normed(y, self.eps, y.pow(2).mean(-1, keepdim=True)) * self.weight).to(x.dtype)


@correct("9.3")
class RMSNormWithRsqrt(_NormBase):
    def forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


@correct("9.3")
class RMSNormWithFRmsNorm(_NormBase):
    def forward(self, x):
        wide = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(wide), (self.dim,), self.weight.to(wide), eps=self.eps).to(x.dtype)


@correct("9.3")
class RMSNormMaxScaledWithItsEps(_NormBase):
    """Divides by the row's max first and scales eps along (eps / max²): the same result."""
    def forward(self, x):
        xf = x.double()
        m = xf.abs().amax(-1, keepdim=True).clamp_min(1e-150)
        y = xf / m
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps / m.pow(2)) * self.weight).to(x.dtype)


@correct("9.3")
class RMSNormRecordsItsStatistic(_NormBase):
    """Records the last root mean square on the module (for a plot), never reads it back; the weight untouched."""
    def forward(self, x):
        xf = x.float()
        ms = xf.pow(2).mean(-1, keepdim=True)
        self.last_rms = ms.detach().sqrt()
        return (_normed(xf, self.eps, ms) * self.weight).to(x.dtype)


@correct("9.3")
class RMSNormCastsACopyOfTheWeight(_NormBase):
    """Casts the weight to the computing dtype out of place (a copy): the parameter itself is left as it is."""
    def forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        weight = self.weight.to(xf.dtype)
        return (_normed(xf, self.eps, xf.pow(2).mean(-1, keepdim=True)) * weight).to(x.dtype)


# ============================================================================ 8.1 tolerances the boundary lets through
# (a negative one, a string, NaN are refused before any verdict: tests/test_check_options.py)
from bank.attempts import Attempt  # noqa: E402
from course_lib.classroom.training_runs import TrainingRun  # noqa: E402


def _run(label, val, **kw):
    return TrainingRun(label, [1, 2, 3], [3.0, 2.5, 2.2], [50, 100], list(val), trained_on=("names", 0, 3e-3), **kw)


_REF = _run("reference", [2.4, 2.0], yours_asked=())
CORRECT.append(Attempt("8.1", "runs_alike_at_the_default_tolerance", (_run("yours", [2.41, 2.01], not_yours=()), _REF),
                       None))
CORRECT.append(Attempt("8.1", "runs_alike_at_tolerance_zero", (_run("yours", [2.4, 2.0], not_yours=()), _REF), None,
                       kwargs={"tolerance": 0}))
CORRECT.append(Attempt("8.1", "runs_at_a_numpy_tolerance", (_run("yours", [2.41, 2.04], not_yours=()), _REF), None,
                       kwargs={"tolerance": np.float32(0.05)}))
CORRECT.append(Attempt("8.1", "runs_at_an_int_tolerance", (_run("yours", [2.41, 2.5], not_yours=()), _REF), None,
                       kwargs={"tolerance": 1}))
CORRECT.append(Attempt("8.1", "runs_at_a_negative_zero_tolerance", (_run("yours", [2.4, 2.0], not_yours=()), _REF),
                       None, kwargs={"tolerance": -0.0}))
