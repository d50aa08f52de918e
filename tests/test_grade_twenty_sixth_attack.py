"""A twenty-sixth attack, on the course's functions through raw memory (2026-12-02): numpy gives a submission a
writable view of any address, with no audit event (an object whose ``__array_interface__`` names the address, or
``as_strided`` with a stride that reaches it from an array of its own). A submission wrote its own code object into
the course's reference function (``causal_mask``, ``MaskedAttention.forward``): the check then computed the
"expected" answer with the student's wrong code, and a wrong answer passed 2.1 and 2.2 in the grader's sandbox.

Python itself refuses to rebind a function's code there (the sandbox's audit hook); a write to memory asks no one.
The grader now takes every course function's code, defaults, closure and globals (and those of torch's pinned
functions) before the submission runs, and a check after which any of them is another object is ``patched``.
"""
from __future__ import annotations

import platform
import sys

import pytest
from sandboxed_judge import judged_in_sandbox

LINUX = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")

# the primitive: read and write 8 bytes at an address, and the place of a function's code pointer found by reading
# the function's own memory (no interpreter's layout written in)
_PRIMITIVES = {
    "array_interface": '''
class _Mem:
    def __init__(self, addr):
        self.__array_interface__ = {"data": (addr, False), "shape": (8,), "typestr": "|u1", "version": 3}

def _view(addr):
    return _np.asarray(_Mem(addr))
''',
    "as_strided": '''
from numpy.lib.stride_tricks import as_strided as _as_strided
_anchor = _np.zeros(8, _np.uint8)
_base = _anchor.__array_interface__["data"][0]

def _view(addr):
    return _as_strided(_anchor, shape=(2, 8), strides=(addr - _base, 1))[1]
''',
}
_TOOLS = '''
import struct as _st
import numpy as _np
{primitive}
def _read(addr):
    return _st.unpack("<Q", _view(addr).tobytes())[0]

def _write(addr, value):
    _view(addr)[:] = _np.frombuffer(_st.pack("<Q", value), _np.uint8)

def _swap_code(target, code):
    _write(id(code), _read(id(code)) + 1000)   # a reference of its own, never given back
    offset = next(o for o in range(8, 256, 8) if _read(id(target) + o) == id(target.__code__))
    _write(id(target) + offset, id(code))
'''


def _tools(primitive: str) -> str:
    return _TOOLS.format(primitive=_PRIMITIVES[primitive])


def _mask_attack(primitive: str) -> str:
    """2.1: a diagonal-only mask, with the course's causal_mask made to run it too."""
    return ("import torch\nimport course_lib.attention as _a\n" + _tools(primitive) + '''
def _lie(n):
    return torch.eye(n, dtype=torch.bool)

def causal_mask(n, _armed=_swap_code(_a.causal_mask, _lie.__code__)):
    return torch.eye(n, dtype=torch.bool)   # wrong: only the diagonal
''')


_WRONG_SCALE = '''
class MaskedAttention(nn.Module):
    def __init__(self, embed_dim, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        self.register_buffer("mask", causal_mask(max_tokens), persistent=False)

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / self.embed_dim          # wrong: the square root is meant
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(weights @ v))
'''
_ARMED = "\n    _armed = _swap_code(_a.MaskedAttention.forward, forward.__code__)\n"


def _attention_attack(primitive: str) -> str:
    """2.2: a scale by embed_dim, with the course's MaskedAttention.forward made to run it too."""
    return ("import torch\nimport torch.nn as nn\nimport course_lib.attention as _a\n"
            "from course_lib.attention import causal_mask\n" + _tools(primitive) + _WRONG_SCALE + _ARMED)


@pytest.mark.parametrize("primitive", sorted(_PRIMITIVES))
def test_the_primitive_writes_a_functions_code_here(primitive):
    """The attack does what it says on this interpreter: a function then runs another's code."""
    namespace: dict = {}
    exec(compile(_tools(primitive), "<student>", "exec"), namespace)  # noqa: S102 - the attack's own tools

    def target():
        return "course"

    def other():
        return "student"
    namespace["_swap_code"](target, other.__code__)
    assert target() == "student" and target.__code__ is other.__code__


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the grader's sandbox (seccomp, namespaces) is built on Linux")
@pytest.mark.parametrize("primitive", sorted(_PRIMITIVES))
def test_a_reference_given_the_students_code_through_memory_is_patched(tmp_path, primitive):
    right = "import torch\ndef causal_mask(n):\n    return torch.ones(n, n, dtype=torch.bool).tril()\n"
    wrong = "import torch\ndef causal_mask(n):\n    return torch.eye(n, dtype=torch.bool)\n"
    # the attack last: judged_in_sandbox runs all three in one process (the grader forks one per exercise)
    verdicts = judged_in_sandbox(tmp_path, "2.1", [wrong, right, _mask_attack(primitive)])
    assert [(v["passed"], v["diagnosis"]) for v in verdicts] == [(False, "causal_mask"), (True, None),
                                                                 (False, "patched")], verdicts


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the grader's sandbox (seccomp, namespaces) is built on Linux")
def test_a_module_method_given_the_students_code_through_memory_is_patched(tmp_path):
    attack = _attention_attack("as_strided")
    plain = attack.replace(_ARMED, "\n")   # the same wrong class, not armed
    verdicts = judged_in_sandbox(tmp_path, "2.2", [plain, attack])
    assert [(v["passed"], v["diagnosis"]) for v in verdicts] == [(False, "scale"), (False, "patched")], verdicts
