"""State built on a first call (a memo, a cache, a weight cast once) meets the device and dtype probes.

``_device_probe.probe_module`` runs the module's calls again on a copy, first on the CPU and then moved to meta
(``probe_after_cpu_calls``), with a KV cache where the exercise has one; ``probes.module_in_float64`` runs a module
again after a first call in the default dtype and model.double(). Here on small modules of this file's own, so
that the engine's behaviour is pinned apart from any exercise (the bank, tests/bank/search30_bugs.py, has the
students' attempts).
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from course_lib.classroom.checks._device_probe import probe_after_cpu_calls, probe_module
from course_lib.classroom.checks.engine.probes import module_in_float64
from course_lib.classroom.verdict import Failure

_GLOBAL: dict = {}


class _Masked(nn.Module):
    """Causal self-attention of one head over x (N, L, 4), with the causal mask from ``self.mask(L, x)``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def mask(self, length: int, x: torch.Tensor) -> torch.Tensor:
        return torch.ones(length, length, dtype=torch.bool, device=x.device).tril()

    def forward(self, x: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        start = 0 if cache is None else len(cache)
        if cache is not None:
            cache.extend(x.unbind(1))
        keys = x if cache is None else torch.stack(cache, 1)
        total, length = keys.shape[1], x.shape[1]
        scores = x @ keys.transpose(-2, -1) / math.sqrt(4)
        allowed = self.mask(total, x)[start:total] if cache is None else self.cached_mask(start, length, total, x)
        return self.proj(scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ keys)

    def cached_mask(self, start: int, length: int, total: int, x: torch.Tensor) -> torch.Tensor:
        return torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[start:total]


class _KeptOnItself(_Masked):
    def mask(self, length, x):
        return self.__dict__.setdefault("masks", {}).setdefault(length, super().mask(length, x))


class _KeptInAGlobalByLength(_Masked):
    def mask(self, length, x):
        return _GLOBAL.setdefault(("length", id(self), length), super().mask(length, x))


@functools.cache
def _lru_mask(module, length):
    return torch.ones(length, length, dtype=torch.bool, device=module.proj.weight.device).tril()


class _KeptInAnLruCache(_Masked):
    def mask(self, length, x):
        return _lru_mask(self, length)


class _KeptByLengthAndDevice(_Masked):
    def mask(self, length, x):
        return self.__dict__.setdefault("masks", {}).setdefault((length, x.device), super().mask(length, x))


class _Buffer(_Masked):
    def __init__(self):
        super().__init__()
        self.register_buffer("full", torch.ones(8, 8, dtype=torch.bool).tril(), persistent=False)

    def mask(self, length, x):
        return self.full[:length, :length]


class _CpuOnTheCachedPath(_Masked):
    def cached_mask(self, start, length, total, x):
        return torch.arange(total, device=x.device)[None, :] <= torch.arange(start, start + length)[:, None]


def _fresh_global_key(module: nn.Module) -> None:
    _GLOBAL.setdefault(("alive", id(module)), module)   # kept alive, so that its id is not reused


X = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("cls", [_KeptOnItself, _KeptInAGlobalByLength, _KeptInAnLruCache])
def test_a_mask_kept_by_length_alone_is_a_device_slip(cls):
    module = cls().eval()
    _fresh_global_key(module)
    with pytest.raises(Failure) as raised:
        probe_module(module, X, "the module")
    assert raised.value.diagnosis == "device"
    assert "kept" in raised.value.message and "x.device" in raised.value.message


@pytest.mark.parametrize("cls", [_Masked, _KeptByLengthAndDevice, _Buffer])
def test_a_mask_made_on_the_device_keyed_by_it_or_a_buffer_passes(cls):
    probe_module(cls().eval(), X, "the module", cache=list)


def test_a_tensor_made_on_the_cpu_on_the_cached_path_only_is_seen_with_a_cache():
    module = _CpuOnTheCachedPath().eval()
    probe_module(module, X, "the module")                 # no cache: nothing to see
    with pytest.raises(Failure) as raised:
        probe_module(module, X, "the module", cache=list)
    assert raised.value.diagnosis == "device" and "KV cache" in raised.value.message


def test_probe_after_cpu_calls_is_inconclusive_where_the_cpu_call_raises():
    def boom():
        raise ValueError("not this probe's to judge")
    probe_after_cpu_calls([("a call", boom, lambda: torch.ones(2, 2) + torch.empty(2, 2, device="meta"))])


def test_the_cpu_calls_come_first_and_the_random_state_is_kept():
    kept = {}
    state = torch.random.get_rng_state()

    def on_cpu():
        kept["mask"] = torch.rand(3, 3) > 0.5
    with pytest.raises(Failure):
        probe_after_cpu_calls([("a call", on_cpu, lambda: torch.empty(3, 3, device="meta").masked_fill(
            kept["mask"], 0.0))])
    assert torch.equal(torch.random.get_rng_state(), state)


class _Norm(nn.Module):
    """x / rms(x) * weight, with what it keeps from its first call chosen by ``kept``."""

    def __init__(self, kept: str = ""):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.arange(4.0))
        self.kept = kept

    def forward(self, x):
        out_dtype = self.__dict__.setdefault("first_dtype", x.dtype) if self.kept == "dtype" else x.dtype
        if self.kept == "averager":
            column = self.__dict__.setdefault("column", torch.full((4, 1), 0.25, dtype=x.dtype))
        else:
            column = torch.full((4, 1), 0.25, dtype=x.dtype)
        return (x * torch.rsqrt((x * x) @ column + 1e-6) * self.weight.to(x.dtype)).to(out_dtype)


def _build(kept: str):
    def build():
        candidate, reference = _Norm(kept), _Norm()
        reference.load_state_dict(candidate.state_dict())
        return candidate, reference
    return build


@pytest.mark.parametrize("kept, diagnosis", [("dtype", "dtype"), ("averager", "dtype")])
def test_what_a_first_call_in_float32_kept_shows_after_model_double(kept, diagnosis):
    with pytest.raises(Failure) as raised:
        module_in_float64(_build(kept), torch.randn(2, 3, 4), "the norm")
    assert raised.value.diagnosis == diagnosis
    assert "first call" in raised.value.message and "model.double()" in raised.value.message
    assert "A dtype is written into your code" not in raised.value.message


def test_a_module_that_keeps_nothing_passes_the_dtype_probe_after_a_call():
    module_in_float64(_build(""), torch.randn(2, 3, 4), "the norm")
