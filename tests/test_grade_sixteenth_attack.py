"""A sixteenth and a seventeenth attack on the grader (2026-11-30): ways past the frame refusal, a finalizer that swapped the
verdict with no frame at all, and honest code the refusal failed.

- A frame through a library that hands frames back (``logging.currentframe``, only ``sys._getframe(1)`` inside
  logging): the refusal now walks past any function whose job is to return frames (logging's, inspect's,
  traceback's walkers) to the code that called it.
- Code compiled, or rebuilt with ``code.replace``, under a file name in torch's folder passed for torch's: code the
  student's code makes is the student's, whatever file it names.
- ``sys.setprofile`` at definition time, set and unset before the grader looked: refused to the student's code.
- The engine's guard kept the check's frame in an attribute, reached through ``sys.getprofile().__self__``: it keeps
  the frame's id.
- A finalizer run at every collection swapped the failing verdict in the grader's list: the grader now makes the
  check cell's checker calls itself and keeps their verdicts in its own frame's list, which nothing reaches.

A seventeenth attack went past that refusal seven more ways (a library resuming the frame walker, reading
``tb_frame`` for the caller, or keeping every frame's locals as text; ``code.replace`` called from ``copy``; a
folder swapped for a link into torch's; a thread racing the hook's re-entry flag; torch's resolution callback
reading a frame's locals): every thread's frames and the objects in memory are refused outright; a frame is
refused to a call composed in C, to the student's code, to whoever asks a function that hands frames back, and to
traceback's walker while the student's code runs; a frame attribute only to a few readers while it runs; code made
while the student's code runs is the student's; a link may not lead out of the working folder; the re-entry flag
is per thread.

Honest code failed: ``traceback.format_exc()`` in the student's own ``except`` and ``torch.autograd.detect_anomaly``
(the refusal walked past traceback's frames to the student's), a ``@dataclass`` (the definition inherited the
grader's ``from __future__ import annotations``), and ``@torch.jit.script`` (no source in linecache).
"""
from __future__ import annotations

import platform
import sys

import pytest
from sandboxed_judge import judged_in_sandbox

LINUX = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")
_WRONG = "    return torch.zeros(n, n, dtype=torch.bool)   # wrong: everything hidden\n"
_TORCH_FILE = "import os\n_NAME = os.path.join(os.path.dirname(torch.__file__), '_utils_frames.py')\n"

# each reaches a frame; the sandbox refuses it where the student's code asks
FRAMES = {
    "logging.currentframe": "import logging\ndef causal_mask(n, _f=logging.currentframe()):\n" + _WRONG,
    "compiled under torch's name": (_TORCH_FILE + "_g = {}\nexec(compile('import sys\\ndef frame():\\n"
                                    "    return sys._getframe(1)\\n', _NAME, 'exec'), _g)\n"
                                    "def causal_mask(n, _f=_g['frame']()):\n" + _WRONG),
    "code.replace under torch's name": (_TORCH_FILE + "import sys\ndef _frame():\n    return sys._getframe(1)\n"
                                        "_frame.__code__ = _frame.__code__.replace(co_filename=_NAME)\n"
                                        "def causal_mask(n, _f=_frame()):\n" + _WRONG),
    "sys.setprofile": ("import sys\ndef _install():\n    sys.setprofile(lambda *a: None)\n    sys.setprofile(None)\n"
                       "def causal_mask(n, _i=_install()):\n" + _WRONG),
    # a seventeenth attack: a library resumes the frame walker, reads the attribute, or keeps the locals' text
    "walk_stack resumed by heapq": ("import heapq, traceback\ndef causal_mask(n, _f=heapq.nlargest(9, "
                                    "traceback.walk_stack(None), key=lambda x: 0)):\n" + _WRONG),
    "tb_frame read by string.Formatter": ("import string\ndef _frame():\n    try:\n        raise ValueError\n"
                                          "    except ValueError as e:\n        return string.Formatter().get_field("
                                          "'0.tb_frame', (e.__traceback__,), {})[0]\n"
                                          "def causal_mask(n, _f=_frame()):\n" + _WRONG),
    "the stack's locals as text": ("import traceback\ndef causal_mask(n, _s=traceback.StackSummary.extract("
                                   "traceback.walk_stack(None), capture_locals=True)):\n" + _WRONG),
    "code.replace from copy's reconstruct": (_TORCH_FILE + "import copy, functools, sys, types\n"
                                             "def _grab():\n    return sys._getframe(1)\n"
                                             "class _Rebuild:\n    def __reduce_ex__(self, proto):\n"
                                             "        return (functools.partial(_grab.__code__.replace, "
                                             "co_filename=_NAME), ())\n"
                                             "def causal_mask(n, _f=types.FunctionType(copy.copy(_Rebuild()), "
                                             "globals())()):\n" + _WRONG),
    # an eighteenth: a profile function set through a library, a map between traceback's walker and its summary,
    # a signal handler (handed the frame it interrupts), gc's DEBUG_SAVEALL (dead frames kept in gc.garbage)
    "sys.setprofile through weakref.finalize": ("import sys, weakref\nclass _K:\n    pass\n_k = _K()\n"
                                                "def causal_mask(n, _f=weakref.finalize(_k, sys.setprofile, "
                                                "lambda *a: None)()):\n" + _WRONG),
    "a map between traceback's walker and its summary": (
        "import traceback\ndef _frames():\n    try:\n        raise ValueError\n    except ValueError as e:\n"
        "        traceback.StackSummary._extract_from_extended_frame_gen(map(lambda item: item, traceback."
        "_walk_tb_with_full_positions(e.__traceback__)), capture_locals=False)\n"
        "def causal_mask(n, _f=_frames()):\n" + _WRONG),
    "a signal handler": ("import signal\ndef causal_mask(n, _h=signal.signal(signal.SIGUSR1, lambda s, f: None)):\n"
                         + _WRONG),
    "gc's DEBUG_SAVEALL": "import gc\ndef causal_mask(n, _d=gc.set_debug(gc.DEBUG_SAVEALL)):\n" + _WRONG,
    # a nineteenth: memory read as memory, no frame asked for at all
    "ctypes at an address": ("import ctypes\ndef causal_mask(n, _o=ctypes.py_object.from_address(id(torch))):\n"
                             + _WRONG),
    "/proc/self/mem": "def causal_mask(n, _m=open('/proc/self/mem', 'rb')):\n" + _WRONG,
    "a link into torch's folder": ("import os\ndef _link():\n    os.symlink(os.path.dirname(torch.__file__), "
                                   "'lib_d')\ndef causal_mask(n, _l=_link()):\n" + _WRONG),
}
# each would have turned the failing verdict into a pass; now it cannot
FORGES = {
    "the guard's frame": ("import sys\ndef causal_mask(n):\n    guard = getattr(sys.getprofile(), '__self__', None)\n"
                          "    frame = getattr(guard, 'stop', None)\n    while frame is not None:\n"
                          "        frame.f_locals\n        frame = frame.f_back\n" + _WRONG),
    "a finalizer at every collection": '''
from course_lib.classroom.verdict import CheckResult as _CR
def _swap(found):
    if type(found) is list:
        for i, r in enumerate(found):
            if type(r) is _CR and r.exercise == "2.1" and not r.passed:
                found[i] = _CR("2.1", True, None, "Right.")
def _forge():
    functions = [type(checks).__dict__.get("__getattr__")]
    while functions:
        for cell in getattr(functions.pop(), "__closure__", None) or ():
            _swap(cell.cell_contents)
            functions.append(cell.cell_contents)
class _Again:
    def __init__(self):
        self.me = self
    def __del__(self):
        _Again()
        try:
            _forge()
        except Exception:
            pass
def causal_mask(n, _i=_Again()):
''' + _WRONG,
}
_RIGHT = "torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))"
HONEST = {
    "traceback.format_exc": ("import traceback\ndef causal_mask(n, device=None):\n    try:\n        int('x')\n"
                             f"    except ValueError:\n        traceback.format_exc()\n    return {_RIGHT}\n"),
    "detect_anomaly": ("def causal_mask(n, device=None):\n    with torch.autograd.detect_anomaly():\n"
                       f"        (torch.ones(2, requires_grad=True) * 2).sum().backward()\n    return {_RIGHT}\n"),
    "a dataclass": ("import dataclasses\n@dataclasses.dataclass\nclass Spec:\n    n: int\n"
                    f"def causal_mask(n, device=None):\n    n = Spec(n).n\n    return {_RIGHT}\n"),
    "torch.jit.script": ("@torch.jit.script\ndef _tri(n: int) -> torch.Tensor:\n"
                         "    return torch.tril(torch.ones(n, n, dtype=torch.bool))\n"
                         "def causal_mask(n, device=None):\n    return _tri(n).to(device) if device is not None else _tri(n)\n"),
    "logging": ("import logging\ndef causal_mask(n, device=None):\n    logging.getLogger('mine').warning('n=%d', n)\n"
                f"    return {_RIGHT}\n"),
    "singledispatch registering": ("import functools\n@functools.singledispatch\ndef _size(x):\n"
                                   "    raise TypeError(x)\n@_size.register\ndef _(x: int):\n    return x\n"
                                   f"def causal_mask(n, device=None):\n    n = _size(n)\n    return {_RIGHT}\n"),
    "torch.jit.trace": ("class _Tri(nn.Module):\n    def forward(self, x):\n"
                        "        return torch.tril(torch.ones_like(x, dtype=torch.bool))\n"
                        "def causal_mask(n, device=None):\n    traced = torch.jit.trace(_Tri(), torch.zeros(n, n))\n"
                        "    return traced(torch.zeros(n, n)).to(device) if device is not None else "
                        "traced(torch.zeros(n, n))\n"),
    "an optimizer's step": ("def causal_mask(n, device=None):\n    w = torch.nn.Parameter(torch.ones(2))\n"
                            "    opt = torch.optim.AdamW([w], lr=0.1)\n    w.sum().backward()\n    opt.step()\n"
                            f"    return {_RIGHT}\n"),
    "inspect.getgeneratorstate": ("import inspect\ndef causal_mask(n, device=None):\n    rows = (i for i in range(n))\n"
                                  f"    inspect.getgeneratorstate(rows)\n    return {_RIGHT}\n"),
}


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the sandbox as a forked exercise's process enters it")
def test_frames_are_refused_forges_fail_and_honest_code_passes(tmp_path):
    sources = [*FRAMES.values(), *FORGES.values(), *HONEST.values()]
    verdicts = iter(judged_in_sandbox(tmp_path, "2.1", sources))
    for name, verdict in zip(FRAMES, verdicts):
        assert (verdict["passed"], verdict["diagnosis"]) == (False, "exception"), (name, verdict)
        assert "sandbox does not allow" in verdict["message"], (name, verdict)
    for name, verdict in zip(FORGES, verdicts):
        assert verdict["passed"] is False, (name, verdict)
    for name, verdict in zip(HONEST, verdicts):
        assert verdict["passed"] is True, (name, verdict)
