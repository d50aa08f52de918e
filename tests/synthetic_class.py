"""Synthetic classes for the grader's tests and benchmark: copies of the course notebooks whose
exercise cells hold attempts from the banks (tests/bank), written the way a student writes them.

Nothing here is committed output: every class is written into a temporary folder when needed.
"""
from __future__ import annotations

import inspect
import random
import re
import textwrap
from pathlib import Path
from typing import Any

import nbformat

from course_lib.classroom.assignments import strip_solutions
from course_lib.classroom.grading.plan import grading_plan
from course_lib.course_files import course_notebooks

# What the bank modules import, so that an attempt's source runs the same way in a notebook cell.
_IMPORTS = """\
import math
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
"""
_MODEL_IMPORTS = "from course_lib.model import GPT, FeedForward\n"


def attempt_source(candidate: Any, name: str) -> str:
    """A cell defining ``name`` as the bank's ``candidate`` does (its bank-local bases included)."""
    module = inspect.getmodule(candidate)
    pieces: list[str] = []

    def bases(cls: type) -> None:
        for base in cls.__bases__:
            if base.__module__ == module.__name__:
                bases(base)
                source = textwrap.dedent(inspect.getsource(base))
                if source not in pieces:
                    pieces.append(source)

    if inspect.isclass(candidate):
        bases(candidate)
    own = textwrap.dedent(inspect.getsource(candidate))
    own = re.sub(r"^@(bug|correct)\(.*\n", "", own, flags=re.M)
    own = re.sub(rf"^(class|def) {re.escape(candidate.__name__)}\b", rf"\1 {name}", own, count=1, flags=re.M)
    imports = _IMPORTS + (_MODEL_IMPORTS if "GPT" in own or "FeedForward" in own else "")
    return "\n\n".join([imports, *pieces, own])


def _literal(value: Any) -> str:
    """Python source that makes ``value`` (a tensor, a numpy array or number, or a plain value)."""
    import numpy as np
    import torch
    if isinstance(value, torch.Tensor):
        return f"torch.tensor({value.tolist()!r}, dtype={value.dtype})"
    if isinstance(value, np.ndarray):
        return f"np.array({value.tolist()!r})"
    if isinstance(value, np.generic):
        return f"np.{type(value).__name__}({_literal(value.item())})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_literal(item) for item in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, float) and value != value:
        return "float('nan')"
    return repr(value)


def prediction_source(weights: Any, result: Any) -> str:
    """Exercise 1.1's cell returning the given prediction."""
    return f"{_IMPORTS}\n\ndef my_prediction():\n    return {_literal(weights)}, {_literal(result)}\n"


def write_student(folder: Path, notebooks: list[str], parts: dict[str, str] | None = None, *,
                  solved: bool = False, rename: dict[str, str] | None = None) -> Path:
    """Write a student's notebooks ("01", "02", ...) into ``folder``: learner copies (or the solutions
    with ``solved``), with the exercise cell of each id in ``parts`` replaced by the given source.
    ``rename`` maps a course notebook's number to the file name the student saved it under."""
    plans = grading_plan()
    folder.mkdir(parents=True, exist_ok=True)
    parts = parts or {}
    for path in course_notebooks():
        number = path.name[:2]
        if number not in notebooks:
            continue
        notebook = nbformat.read(path, as_version=4)
        for cell in notebook.cells:
            if cell.cell_type != "code":
                continue
            if not solved and "### BEGIN SOLUTION" in cell.source:
                cell.source = strip_solutions(cell.source)
            for ex_id, source in parts.items():
                if plans[ex_id].notebook == path.name and cell.get("id") == plans[ex_id].cell_id:
                    cell.source = source
            cell.outputs = []
            cell.execution_count = None
        name = (rename or {}).get(number, path.name)
        nbformat.write(notebook, folder / name)
    return folder


def random_class(root: Path, students: int, notebooks: list[str], seed: int = 0) -> dict[str, dict[str, str]]:
    """A class of ``students``, each exercise drawn: a correct attempt (45%), a bank mistake (35%),
    or left unfinished (20%). Returns what each student's exercise holds ("correct", "unfinished" or
    the bank's expected diagnosis)."""
    from bank import attention_bugs, model_bugs
    plans = grading_plan()
    attempts: dict[str, dict[str, list]] = {}
    for bank in (attention_bugs, model_bugs):
        for attempt in bank.CORRECT + bank.BUGGY:
            kind = "correct" if attempt.expected is None else "buggy"
            if attempt.expected == "not_implemented":
                continue   # unfinished is drawn on its own
            if attempt.exercise == "4.2" and (attempt.kwargs if kind == "buggy" else attempt.name != "BlockBothWays"):
                continue   # 4.2 is checked pre-norm, then post-norm: a right block must be right both ways
            attempts.setdefault(attempt.exercise, {}).setdefault(kind, []).append(attempt)
    rng = random.Random(seed)
    drawn: dict[str, dict[str, str]] = {}
    for number in range(students):
        student = f"student{number:02d}"
        parts: dict[str, str] = {}
        holds: dict[str, str] = {}
        for ex_id, plan in plans.items():
            if plan.number not in notebooks or ex_id not in attempts:
                continue
            roll = rng.random()
            kind = "correct" if roll < 0.45 else "buggy" if roll < 0.8 else "unfinished"
            if kind == "unfinished" or not attempts[ex_id].get(kind):
                holds[ex_id] = "unfinished"
                continue
            attempt = rng.choice(attempts[ex_id][kind])
            if ex_id == "1.1":
                parts[ex_id] = prediction_source(*attempt.candidate)
            else:
                parts[ex_id] = attempt_source(attempt.candidate, plan.name)
            holds[ex_id] = attempt.expected or "correct"
        write_student(root / student, notebooks, parts)
        drawn[student] = holds
    return drawn


def hostile_parts(victim: Path, submissions: Path, report: Path) -> dict[str, str]:
    """Exercise cells of notebooks 01-03 that attack the grader, one attack (or family) per exercise.

    Where an attack is one the sandbox should refuse, the cell does the exercise right after trying
    it, and raises if the attack got through: a pass means every attempt was refused.
    """
    return {
        # signalling others: the worker that runs us, every process of ours; starting processes
        "1.1": '''
import os, signal, subprocess

def my_prediction():
    attacks = {"kill the worker": lambda: os.kill(os.getppid(), signal.SIGKILL),
               "kill a process group": lambda: os.killpg(os.getpgid(os.getppid()), signal.SIGKILL),
               "subprocess": lambda: subprocess.run(["true"]), "os.system": lambda: os.system("true"),
               "fork": os.fork}
    for name, attack in attacks.items():
        try:
            pid = attack()
        except Exception:
            continue
        if name == "fork" and pid == 0:
            os._exit(0)
        raise RuntimeError(f"attack got through: {name}")
    return [0.21, 0.58, 0.21], 2.0
''',
        # an endless loop that swallows the checker's own timer
        "1.2": '''
def toy_attention(query, keys, values):
    while True:
        try:
            while True:
                pass
        except BaseException:
            pass
''',
        "1.3": '''
import sys

def scaled_dot_product_attention(q, k, v, mask=None):
    sys.exit(3)
''',
        "2.1": '''
import os

def causal_mask(n):
    os._exit(7)
''',
        "2.2": '''
import os, signal

class MaskedAttention(nn.Module):
    def __init__(self, embed_dim, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, x):
        os.kill(os.getpid(), signal.SIGKILL)
''',
        # 3 GB of address space: fine without a limit, refused under a smaller one
        "3.1": '''
def split_heads(x, num_heads):
    hoard = bytearray(3 * 2 ** 30)
    n, length, embed_dim = x.shape
    return x.view(n, length, num_heads, embed_dim // num_heads).transpose(1, 2)
''',
        # writing over another student's notebook and into the report
        "3.2": f'''
def merge_heads(x):
    targets = [{str(victim)!r}, {str(report / "grades.csv")!r}, {str(report / "feedback" / "alice.md")!r},
               {str(report / "evil.md")!r}]
    for target in targets:
        try:
            with open(target, "w") as handle:
                handle.write("tampered")
        except OSError:
            continue
        raise RuntimeError(f"attack got through: wrote {{target}}")
    n, heads, length, head_dim = x.shape
    return x.transpose(1, 2).reshape(n, length, heads * head_dim)
''',
        # reading another student's files, the submissions folder, the grader's memory
        # the attacks first, then the course's solution (its own code: calling the course's class would be
        # a verdict of its own, calls_reference)
        "3.3": f'''
import os

def _attack():
    attacks = {{"read a notebook": lambda: open({str(victim)!r}).read(),
               "list the submissions": lambda: os.listdir({str(submissions)!r}),
               "read the worker's memory map": lambda: open(f"/proc/{{os.getppid()}}/maps").read()}}
    for name, attack in attacks.items():
        try:
            attack()
        except OSError:
            continue
        raise RuntimeError(f"attack got through: {{name}}")

def _attacking(cls):
    forward = cls.forward
    def attacked(self, x, *args, **kwargs):
        _attack()
        return forward(self, x, *args, **kwargs)
    cls.forward = attacked
    return cls

''' + grading_plan(["3.3"])["3.3"].solution.replace("class MultiHeadMaskedAttention", "@_attacking\nclass MultiHeadMaskedAttention", 1),
    }


FORGED_VERDICT = '''
import os, json

def causal_mask(n):
    forged = json.dumps({"exercise": "2.1", "passed": True, "diagnosis": None, "message": "forged"}).encode()
    for fd in range(3, 64):
        try:
            os.write(fd, forged)
        except OSError:
            pass
    os._exit(0)
'''


# Submissions that try to write their own pass into the grader, each with a wrong answer (or, where the
# attack is one the sandbox refuses, the right answer after it, raising if the attack got through).
FORGERIES = {
    # the recorder standing for `checks`: an attribute set on it
    "1.1": '''
_forged = setattr(checks, "verdicts", lambda: [])

def my_prediction(_x=_forged):
    return [0.0, 1.0, 0.0], 1.0
''',
    # json's encoder rewriting the worker's reply to "passed"
    "1.2": '''
import json

_encode = json.JSONEncoder.encode

def _forge(self, o):
    if isinstance(o, dict) and isinstance(o.get("verdict"), dict):
        o["verdict"].update(passed=True, diagnosis=None, message="forged")
    return _encode(self, o)

_forged = setattr(json.JSONEncoder, "encode", _forge)

def toy_attention(query, keys, values, _x=_forged):
    return values.sum(0) * 0
''',
    # os.write rewriting every false on its way out
    "1.3": '''
import os

_write = os.write
_forged = setattr(os, "write", lambda fd, data: _write(fd, data.replace(b"false", b"true ")))

def scaled_dot_product_attention(q, k, v, mask=None, _x=_forged):
    return v * 0
''',
    # a helper of the checker replaced
    "2.1": '''
import course_lib.classroom.checks.notebook02 as _checker

_forged = setattr(_checker, "judge", lambda *args: "forged")

def causal_mask(n, _x=_forged):
    return torch.zeros(n, n, dtype=torch.bool)
''',
    # a process started through the C helper that raises no audit event
    "3.1": '''
import multiprocessing.util

def split_heads(x, num_heads):
    try:
        multiprocessing.util.spawnv_passfds("/bin/true", ["true"], ())
    except Exception:
        n, length, embed = x.shape
        return x.view(n, length, num_heads, embed // num_heads).transpose(1, 2)
    raise RuntimeError("attack got through: fork_exec")
''',
    # a copy of the course's code that says it was compiled elsewhere
    "3.2": '''
import types

_copy = types.FunctionType(merge_heads.__code__.replace(co_name="mine", co_filename="mine.py"),
                           merge_heads.__globals__, "mine")

def merge_heads(x, _f=_copy):
    return _f(x)
''',
    # the reference guard switched off, then the course's class under the student's name
    "3.3": '''
import course_lib.classroom.checks.engine.run as _run

_forged = setattr(_run, "reference_of", lambda exercise: None)

class MultiHeadMaskedAttention(MultiHeadMaskedAttention):
    off = _forged
''',
}


# A third scripted attack on the grader (2026-11-29): each a way to a pass without the work. Every one must fail.
FORGERIES_2 = {
    # a Tensor subclass whose __torch_function__ answers the check's torch.equal with True
    "1.2": '''
class _Agreeable(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.equal, torch.allclose):
            return True
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

def toy_attention(query, keys, values):
    return (values.sum(0) * 0).as_subclass(_Agreeable)
''',
    # a TorchFunctionMode entered when the cell runs, answering every torch.equal with True
    "1.3": '''
from torch.overrides import TorchFunctionMode

class _Yes(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.equal, torch.allclose, torch.Tensor.equal):
            return True
        return func(*args, **(kwargs or {}))

_mode = _Yes().__enter__()

def scaled_dot_product_attention(q, k, v, mask=None, _m=_mode):
    return v * 0
''',
    # the course's checker replaced in its module before the grader's recorder takes it
    "2.1": '''
import course_lib.classroom.checks as _checks
from course_lib.classroom.verdict import CheckResult as _Result

_forged = setattr(_checks, "check_causal_mask", lambda *args, **kwargs: _Result("2.1", True, None, "forged"))

def causal_mask(n, _x=_forged):
    return torch.zeros(n, n, dtype=torch.bool)
''',
    # the profiler that watches for the course's own code switched off, then the course's class called
    "2.2": '''
import sys
import course_lib.attention as _course

class MaskedAttention(_course.MaskedAttention):
    def forward(self, x):
        try:
            sys.setprofile(None)
        except RuntimeError:
            pass
        return _course.MaskedAttention.forward(self, x)
''',
    # the course's function called from a thread, where the calling thread's profiler does not reach
    "3.1": '''
import threading
import course_lib.attention as _course

def split_heads(x, num_heads):
    box = []
    thread = threading.Thread(target=lambda: box.append(_course.split_heads(x, num_heads)))
    thread.start()
    thread.join()
    return box[0] if box else x
''',
    # the course's function called from code compiled under a file name that looks like the course's
    "3.2": '''
import course_lib.attention as _course

def _as_course(fn):
    space = {"_course": _course}
    exec(compile("def merge_heads(x):\\n    return _course.merge_heads(x)\\n", "/x/course_lib/helpers.py", "exec"),
         space)
    return space["merge_heads"]

@_as_course
def merge_heads(x):
    pass
''',
    # memory outside the limit through os's C name for memfd_create; refused, then the right answer
    "3.3": '''
import posix

class MultiHeadMaskedAttention(MultiHeadMaskedAttention):
    def forward(self, x):
        try:
            posix.memfd_create("hoard")
        except Exception:
            n, length, embed = x.shape
            q, k, v = (t(x).view(n, length, self.num_heads, embed // self.num_heads).transpose(1, 2)
                       for t in (self.query, self.key, self.value))
            s = (q @ k.transpose(-2, -1) / (embed // self.num_heads) ** 0.5).masked_fill(
                ~self.mask[:length, :length], float("-inf"))
            out = self.attn_dropout(s.softmax(-1)) @ v
            return self.proj_dropout(self.proj(out.transpose(1, 2).reshape(n, length, embed)))
        raise RuntimeError("attack got through: posix.memfd_create")
''',
}
