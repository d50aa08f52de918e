"""A twenty-fourth attack on the grader (2026-11-30): three classes past the fixes of the twenty-third, none through a
frame, each a wrong function graded ``true``.

- A module given another class (``sys.modules["torch"].__class__ = ...``, or the course's ``course_lib.attention``):
  ``module.name`` asks the class's ``__getattribute__`` first, so torch's ``equal`` answered True and the course's
  reference was the student's own function, while every namespace the judge compares was unchanged. A class is
  given to a module now only by its own top-level code (torch.utils.deterministic does so as it is imported), to a
  class (its metaclass) never, to the course's objects never, to torch's objects not by the student's code; and the
  judge compares the class of every module it knows.
- A name added to a pinned torch class counted only where a pinned base had it, and ``object`` is never pinned:
  ``nn.Module.__getattribute__`` rewrote the reference's forward. A special method, a name any base has, or a
  function of code other than torch's counts now (``nn.Parameter`` is pinned too).
- The course's state in a list or a dict compared by the container alone: ``engine.run._GUARDED[0] = 1`` made every
  reference guard take itself for a nested one and watch nothing. The judge compares what the course's dicts, lists
  and sets hold (but its caches, its last verdicts and the like, which it changes itself as it checks), and the
  sandbox's own record of the files the student's code named its code after with the course's, which the checks read.
"""
from __future__ import annotations

import platform
import sys

import pytest
from sandboxed_judge import judged_in_sandbox

LINUX = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")
_WRONG = "    return torch.zeros(n, n, dtype=torch.bool)   # wrong: everything hidden\n"
_MODULES = "import sys, types\n_M = sys.modules\n"


def _class_of(module: str, asked: str, answers: str) -> str:
    """A submission that gives ``module`` a class whose ``__getattribute__`` answers ``answers`` for ``asked``."""
    return (_MODULES + f"def _go():\n    target = _M[{module!r}]\n    real = types.ModuleType.__getattribute__\n"
            "    class Swapped(type(target)):\n        def __getattribute__(self, name):\n"
            f"            return ({answers}) if name == {asked!r} else real(self, name)\n"
            "    target.__class__ = Swapped\ndef causal_mask(n, _i=_go()):\n" + _WRONG)


REFUSED = {
    "torch's module given a class whose equal says True": _class_of("torch", "equal", "lambda *a, **k: True"),
    "the course's attention module given a class that answers the student's function": _class_of(
        "course_lib.attention", "causal_mask", "globals()['causal_mask']"),
    # refused inside the finalizer, which Python runs and whose error it only prints: the function is judged as it is
    "torch's module given a class from a finalizer": (
        _MODULES + "import weakref\nclass _Box:\n    pass\n"
        "class _Swapped(types.ModuleType):\n    def __getattribute__(self, name):\n"
        "        return (lambda *a, **k: True) if name == 'equal' else types.ModuleType.__getattribute__(self, name)\n"
        "def _arm():\n    box = _Box()\n    weakref.finalize(box, object.__setattr__, _M['torch'], '__class__', _Swapped)\n"
        "    return [box]\ndef causal_mask(n, _i=_arm()):\n    _i.clear()\n" + _WRONG),
    "a frozen declaration of the course given a class of the student's": (
        _MODULES + "def _go():\n    declared = _M['course_lib.classroom.checks.notebook02'].CAUSAL_MASK\n"
        "    kind = type(declared)\n    swapped = type('Swapped', (kind,), {'same': lambda self, out, expected: True})\n"
        "    object.__setattr__(declared, '__class__', swapped)\ndef causal_mask(n, _i=_go()):\n" + _WRONG),
    "a class of the course given a metaclass": (
        _MODULES + "def _go():\n    result = _M['course_lib.classroom.verdict'].CheckResult\n"
        "    result.__class__ = type('Meta', (type,), {})\ndef causal_mask(n, _i=_go()):\n" + _WRONG),
}
# each changes what the judge computes with: ``patched``, in a process of its own as in the grader
PATCHED = {
    "nn.Module.__getattribute__ added": (
        "def _go():\n    real = object.__getattribute__\n"
        "    torch.nn.Module.__getattribute__ = lambda self, name: real(self, name)\n"
        "def causal_mask(n, _i=_go()):\n" + _WRONG),
    "a function added to torch.Tensor": (
        "def _go():\n    torch.Tensor.causal = lambda self: self\ndef causal_mask(n, _i=_go()):\n" + _WRONG),
    "the reference guard's count of guards entered": (
        _MODULES + "def _go():\n    _M['course_lib.classroom.checks.engine.run']._GUARDED[0] = 1\n"
        "def causal_mask(n, _i=_go()):\n    return getattr(_M['course_lib.attention'], 'causal_mask')(n)\n"),
    "a table of the course's emptied": (
        _MODULES + "def _go():\n    for table in vars(_M['course_lib.classroom.checks.engine.run']).values():\n"
        "        if type(table) is list and table == [None]:\n            table[0] = 'watching'\n"
        "def causal_mask(n, _i=_go()):\n" + _WRONG),
    "a claim taken back: code named after torch's files": (
        _MODULES + "def _go():\n    name = torch.__file__\n"
        "    space = {}\n    exec(compile('def ask(n):\\n    return CALL(n)\\n', name, 'exec'), space)\n"
        "    _M['course_lib.classroom.checks._student_files']._CLAIMED.discard(name)\n    return space['ask']\n"
        "def causal_mask(n, _ask=_go()):\n    _ask.__globals__['CALL'] = getattr(_M['course_lib.attention'], "
        "'causal_mask')\n    return _ask(n)\n"),
}
HONEST = {
    "torch's own parametrization gives a layer a class of its own": (
        "def causal_mask(n):\n    layer = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(2, 2))\n"
        "    assert type(layer) is not torch.nn.Linear\n"
        "    return torch.ones(n, n).tril() > 0\n"),
    "a class of the student's own given another class": (
        "class _A:\n    pass\nclass _B:\n    pass\n"
        "def causal_mask(n):\n    thing = _A()\n    thing.__class__ = _B\n    return torch.ones(n, n).tril() > 0\n"),
}


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the sandbox as a forked exercise's process enters it")
def test_the_twenty_fourth_attacks_are_refused_or_patched_and_honest_code_passes(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    verdicts = iter(judged_in_sandbox(home, "2.1", [*HONEST.values(), *REFUSED.values()]))
    for name, verdict in zip(HONEST, verdicts):
        assert verdict["passed"] is True, (name, verdict)
    for name, verdict in zip(REFUSED, verdicts):
        if "finalizer" in name:
            assert (verdict["passed"], verdict["diagnosis"]) == (False, "causal_mask"), (name, verdict)
        else:
            assert (verdict["passed"], verdict["diagnosis"]) == (False, "exception"), (name, verdict)
            assert "sandbox does not allow" in verdict["message"], (name, verdict)
    for index, (name, source) in enumerate(PATCHED.items()):   # each in a process of its own, as in the grader
        (tmp_path / str(index)).mkdir()
        verdict, = judged_in_sandbox(tmp_path / str(index), "2.1", [source])
        assert (verdict["passed"], verdict["diagnosis"]) == (False, "patched"), (name, verdict)
        assert "changed the course's own code" in verdict["message"] or "has been replaced" in verdict["message"], \
            (name, verdict)
