"""The grader's isolation (bubblewrap): hostile submissions graded beside honest ones change nothing of theirs.

Each attack below got through the audit-hook sandbox alone (issue 21); isolated, each must leave
the honest students' grades, their files and the report as they would be without the attacker.
An attack cell does the exercise right after trying its attack, and raises "attack got through"
if the attack worked: so a pass means the attack was stopped. The class is graded once, through
the command, in a fresh process (a frozen or killed grader cannot take pytest with it).

Skipped only where bwrap cannot run (macOS, Windows, a machine without it); CI installs it.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from synthetic_class import write_student

import course_lib
from course_lib.classroom.grading import isolation
from course_lib.classroom.grading.plan import grading_plan


def _bubblewrap_runs() -> bool:
    """bwrap is installed and can make its namespaces here (what .ci/run checks before the tests)."""
    if shutil.which("bwrap") is None:
        return False
    smoke = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
             "--dev", "/dev", "true"]
    return subprocess.run(smoke, capture_output=True).returncode == 0


# Skipped only where bubblewrap itself cannot run; where it runs, the grader's isolation must too.
pytestmark = pytest.mark.skipif(not _bubblewrap_runs(), reason="bubblewrap is not installed or cannot make "
                                "namespaces here (apt-get install bubblewrap; .ci/run installs it)")


def test_the_grader_isolates_wherever_bubblewrap_runs():
    """Wherever bwrap runs, whatever folder the course and its venv live in (/tmp included)."""
    assert isolation.available(), isolation.status()[1]

EXERCISES = ["1.1", "1.2", "1.3", "2.1", "2.2"]
MARKER = "alice-secret-7f3a"   # in alice's notebook: must never reach anyone's feedback
PLANS = grading_plan(EXERCISES)
RIGHT = {  # a right answer to finish each attack cell with
    "1.1": "    return [0.21, 0.58, 0.21], 2.0\n",
    "1.2": "    return torch.softmax(keys @ query, dim=0) @ values\n",
    "1.3": ("    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])\n"
            "    if mask is not None:\n        scores = scores.masked_fill(~mask, float('-inf'))\n"
            "    return torch.softmax(scores, dim=-1) @ v\n"),
    "2.1": "    return torch.ones(n, n, dtype=torch.bool).tril()\n",
}
SIGNATURES = {"1.1": "my_prediction()", "1.2": "toy_attention(query, keys, values)",
              "1.3": "scaled_dot_product_attention(q, k, v, mask=None)", "2.1": "causal_mask(n)"}


def _cell(exercise: str, attack: str) -> str:
    """An exercise cell that runs ``attack`` (a function body returning None when it was stopped, else
    what got through) on its first call, then answers right."""
    body = "\n".join("    " + line for line in attack.strip("\n").splitlines())
    return (f"import math, os, sys, json, signal, _posixsubprocess, time\nimport torch\n\n{SPAWN}\n\n"
            f"def _attack():\n{body}\n\n"
            f"def {SIGNATURES[exercise]}:\n"
            f"    got = _attack()\n    if got:\n        raise RuntimeError(f'attack got through: {{got}}')\n"
            + RIGHT[exercise])


# Starts a process with _posixsubprocess.fork_exec, which raises no audit event (its arguments vary by version);
# the sandbox replaces it with a refusal, so each attack through it now stops there.
SPAWN = """
def _spawn(argv):
    args = [os.fsencode(a) for a in argv]
    errors_read, errors_write = os.pipe()
    head = [args, [args[0]], True, (), None, None, -1, -1, -1, -1, -1, -1, errors_read, errors_write, False, False]
    for tail in ([-1, None, None, None, -1, None, False], [-1, None, None, None, -1, None],
                 [None, None, None, -1, None, False]):
        try:
            return _posixsubprocess.fork_exec(*head, *tail)
        except TypeError:
            continue
    raise RuntimeError("no fork_exec signature fits")
"""


def _attacks(root: Path) -> dict[str, dict[str, str]]:
    alice = root / "class" / "alice" / "01_attention_toy.ipynb"
    report = root / "report"
    grades_csv = report / "grades.csv"
    package = Path(course_lib.__file__).parent
    forged = ('{"type": "grade", "student": "alice", "exercise": "2.1", "seconds": 0, "verdict": {"exercise": '
              '"2.1", "passed": false, "diagnosis": "crashed", "message": "forged"}}\n')
    late_edit = (f"import time, os\nfor _ in range(150):\n    for p in ({str(grades_csv)!r}, {str(alice)!r}):\n"
                 f"        try:\n            open(p, 'a').write('tampered')\n        except OSError:\n"
                 f"            pass\n    time.sleep(0.1)\n")
    grader = root / "grader"
    solution_line = "return torch.ones(n, n, dtype=torch.bool).tril()"
    checkout_notebooks = Path(course_lib.__file__).parents[1] / "notebooks"
    leaks = {
        "mallory": {
            # the instructor's environment: a token of the grader's shell
            "1.1": f"""
got = [name for name, value in os.environ.items() if {TOKEN!r} in value or name == "GRADER_TOKEN"]
for path in ("/proc/self/environ", "/proc/1/environ", "/proc/1/cmdline"):
    try:
        if {TOKEN!r}.encode() in open(path, "rb").read():
            got.append(path)
    except OSError:
        pass
return got
""",
            # the folder the grader runs from: last run's grades, nbgrader's database
            "1.2": f"""
got = []
for path in ({str(grader / "grades.csv")!r}, {str(grader / "gradebook.db")!r}, {str(report)!r}):
    try:
        got.append((path, open(path, "rb").read(100)))
    except OSError:
        pass
    try:
        got.append((path, os.listdir(path)))
    except OSError:
        pass
return got
""",
            # the course's solution notebooks, wherever the package or the checkout keeps them
            "1.3": f"""
from course_lib.course_files import notebooks_dir
got = []
for folder in (str(notebooks_dir()), {str(checkout_notebooks)!r}):
    try:
        names = os.listdir(folder)
    except OSError:
        continue
    for name in names:
        try:
            if {solution_line!r} in open(os.path.join(folder, name), encoding="utf-8").read():
                got.append(os.path.join(folder, name))
        except OSError:
            pass
return got
""",
            # the host: /etc beyond what Python needs, the kernel's command line, the host's paths in the mount table
            "2.1": f"""
got = sorted(set(os.listdir("/etc")) - {{"ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime"}})
try:
    got.append(open("/proc/cmdline").read()[:80])
except OSError:
    pass
mounts = open("/proc/self/mountinfo").read()
got += [path for path in ({str(alice.parent.parent)!r}, {str(report)!r}, {str(grader)!r}) if path in mounts]
return got
""",
        },
    }
    return {
        **leaks,
        "trudy": {
            # read another student's notebook through dir_fd (the audit hook once resolved it wrongly)
            "1.1": f"""
root = os.open("/", os.O_RDONLY)
try:
    fd = os.open({str(alice)[1:]!r}, os.O_RDONLY, dir_fd=root)
except OSError:
    return None
return os.read(fd, 1 << 20).decode(errors="replace")[:3000]
""",
            # write through dir_fd: another's notebook, the report, the installed package
            "1.2": f"""
root = os.open("/", os.O_RDONLY)
got = []
for target in ({str(alice)[1:]!r}, {str(grades_csv)[1:]!r}, {str(package / "attack_probe.py")[1:]!r}):
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644, dir_fd=root)
        os.write(fd, b"tampered")
        got.append(target)
    except OSError:
        pass
return got
""",
            # forge other students' grades: write verdict lines into every pipe of every process in /proc
            "1.3": f"""
got = []
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        fds = os.listdir(f"/proc/{{pid}}/fd")
    except OSError:
        continue
    for fd in fds:
        try:
            handle = os.open(f"/proc/{{pid}}/fd/{{fd}}", os.O_WRONLY | os.O_NONBLOCK)
            os.write(handle, {forged!r}.encode())
            got.append((pid, fd))
        except OSError:
            pass
return None   # writing into our own worker only forges our own grades: the check is on alice's
""",
            # leave a process behind that keeps editing the report and alice's notebook, then kill our worker
            "2.1": f"_spawn([sys.executable, '-c', {late_edit!r}])\n" + """
_spawn([sys.executable, "-c", f"import os; os.kill({os.getppid()}, 9)"])   # our worker, past the audit hook
time.sleep(5)
return None
""",
        },
        "oscar": {
            # a process storm that no audit hook sees
            "1.1": """
started = 0
for _ in range(300):
    try:
        _spawn(["/bin/sleep", "30"])
        started += 1
    except OSError:
        break
return f"{started} processes" if started >= 100 else None
""",
            # fill the temporary folder every student shares (it is each sandbox's own now)
            "1.2": """
import tempfile
written = 0
try:
    for i in range(64):
        with open(os.path.join(tempfile.gettempdir(), f"fill{i}"), "wb") as handle:
            for _ in range(16):
                handle.write(b"x" * (1 << 20))
                written += 1
except OSError:
    pass
return f"{written} MB" if written > 1024 else None
""",
            # freeze the grader: SIGSTOP every process of the grading command it can see
            "1.3": """
stopped = []
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        command = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        continue
    if b"course_lib" in command and b"grade" in command and b"worker" not in command:
        try:
            os.kill(int(pid), signal.SIGSTOP)
            stopped.append(pid)
        except OSError:
            pass
return stopped
""",
        },
    }


PARSE_BOMB = "x = " + "-" * 100000 + "1"
TOKEN = "grader-token-51f0c2"   # in the grader's environment: never in a sandbox, never on a command line


def _watch_command_lines(process: subprocess.Popen) -> list[str]:
    """While ``process`` runs, every command line on this machine holding TOKEN (what `ps` shows anyone)."""
    import threading
    found: list[str] = []

    def watch() -> None:
        while process.poll() is None:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if TOKEN.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                        found.append(pid)
                except OSError:
                    continue
            time.sleep(0.2)
    threading.Thread(target=watch, daemon=True).start()
    return found


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    root = tmp_path_factory.mktemp("isolated")
    submissions, report = root / "class", root / "report"
    write_student(submissions / "alice", ["01", "02"], solved=True)
    alice = submissions / "alice" / "01_attention_toy.ipynb"
    alice.write_text(alice.read_text().replace("Toy attention", f"Toy attention {MARKER}", 1))
    write_student(submissions / "learner", ["01", "02"])
    for student, attacks in _attacks(root).items():
        write_student(submissions / student, ["01", "02"], {ex: _cell(ex, attack) for ex, attack in attacks.items()})
    # a parse bomb in a cell before oscar's 2.1 (which is right): parsed inside his sandbox
    import nbformat
    path = submissions / "oscar" / "02_masked_attention.ipynb"
    notebook = nbformat.read(path, as_version=4)
    index = next(i for i, c in enumerate(notebook.cells) if c.get("id") == PLANS["2.1"].cell_id)
    notebook.cells[index].source = _cell("2.1", "return None")
    notebook.cells.insert(index, nbformat.v4.new_code_cell(PARSE_BOMB))
    nbformat.write(notebook, path)
    # a notebook that grows to gigabytes when parsed (24 MB of empty objects)
    write_student(submissions / "inflater", ["01"])
    (submissions / "inflater" / "02_masked_attention.ipynb").write_text(json.dumps(
        {"nbformat": 4, "nbformat_minor": 5, "metadata": {"x": [{}] * 8_000_000}, "cells": []},
        separators=(",", ":")))
    before = {p: p.read_bytes() for p in submissions.rglob("*") if p.is_file() and "alice" in p.parts}
    grader = root / "grader"   # the folder the instructor grades from, nbgrader-style
    grader.mkdir()
    (grader / "grades.csv").write_text("student,grade\nalice,100\n")
    (grader / "gradebook.db").write_bytes(b"SQLite format 3\x00 alice")
    env = {**os.environ, "GRADER_TOKEN": TOKEN,
           "PYTHONPATH": os.pathsep.join([str(Path(course_lib.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    # 60 s a notebook, 30 s an exercise: oscar's 1.2 fills its 512 MB scratch before it answers, which took past
    # a 20 s share on a loaded 2-core CI machine (a timeout there is no attack stopped, only a slow disk)
    grading = subprocess.Popen([sys.executable, "-m", "course_lib", "grade", str(submissions), "--out", str(report),
                                "--workers", "2", "--exercises", ",".join(EXERCISES), "--timeout", "60",
                                "--memory-mb", "512", "--isolation", "on", "--quiet"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=grader, start_new_session=True)
    on_command_lines = _watch_command_lines(grading)
    out, err = grading.communicate(timeout=400)
    done = subprocess.CompletedProcess(grading.args, grading.returncode, out, err)
    seconds = time.monotonic() - start
    csv_after_run = (report / "grades.csv").read_bytes() if (report / "grades.csv").exists() else b""
    time.sleep(3)   # a process left behind would edit the report now
    rows = list(csv.DictReader(io.StringIO((report / "grades.csv").read_text())))
    return {"done": done, "seconds": seconds, "root": root, "report": report, "before": before,
            "on_command_lines": on_command_lines,
            "csv_after_run": csv_after_run, "grades": {(r["student"], r["exercise"]): r for r in rows}}


@pytest.mark.slow
def test_honest_students_are_graded_as_without_attackers(attacked):
    done, grades = attacked["done"], attacked["grades"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "grading isolated" in done.stderr
    for ex in EXERCISES:
        assert grades["alice", ex]["passed"] == "true", grades["alice", ex]
        assert grades["learner", ex]["diagnosis"] == "not_implemented", grades["learner", ex]
    assert all("forged" not in row["message"] for row in grades.values())


@pytest.mark.slow
def test_files_and_report_are_untouched_after_the_run(attacked):
    for path, data in attacked["before"].items():
        assert path.read_bytes() == data, path
    assert (attacked["report"] / "grades.csv").read_bytes() == attacked["csv_after_run"]
    assert "tampered" not in (attacked["report"] / "grades.csv").read_text()
    assert not (Path(course_lib.__file__).parent / "attack_probe.py").exists()
    feedback = "".join(p.read_text() for p in (attacked["report"] / "feedback").iterdir())
    assert MARKER not in feedback


@pytest.mark.slow
def test_every_attack_was_stopped_and_only_hurt_the_attacker(attacked):
    grades = attacked["grades"]
    outcome = {(s, ex): (g["passed"], g["diagnosis"], g["message"][:160]) for (s, ex), g in grades.items()
               if s in ("trudy", "oscar")}
    for key in [("trudy", "1.3"), ("oscar", "1.1"), ("oscar", "1.2")]:
        assert outcome[key][0] == "true", (key, outcome[key])          # refused, then the right answer
    for key in [("trudy", "1.1"), ("trudy", "1.2")]:   # a descriptor of "/" for dir_fd is refused outright
        assert outcome[key][:2] == ("false", "exception") and "opening the folder /:" in grades[key]["message"], \
            grades[key]
    # a process past the audit hook (fork_exec) is refused too: the attack stops at its first line
    assert outcome["trudy", "2.1"][1] == "exception" and "starting another process" in outcome["trudy", "2.1"][2]
    assert outcome["oscar", "1.3"][0] == "true", outcome["oscar", "1.3"]   # the grader was not visible
    assert outcome["oscar", "2.1"][0] == "true", outcome["oscar", "2.1"]   # the parse bomb cell is skipped
    assert all(g["diagnosis"] != "checker_error" for g in grades.values())


@pytest.mark.slow
def test_nothing_the_submissions_started_outlives_the_run(attacked):
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        # the attacks' own command lines (the shared machine may run a `sleep 30` of its own: not ours)
        if b"open(p, 'a').write('tampered')" in command or command.startswith(b"/bin/sleep\x0030"):
            left.append(f"{pid}: {command[:100]!r}")
            os.kill(int(pid), signal.SIGKILL)
    assert left == []


@pytest.mark.slow
def test_the_sandbox_sees_only_what_the_worker_needs(attacked):
    """Allow-lists: the grader's environment, its folder, the solutions and the host stay outside."""
    grades = attacked["grades"]
    for exercise in ("1.1", "1.2", "1.3", "2.1"):
        assert grades["mallory", exercise]["passed"] == "true", (exercise, grades["mallory", exercise])
    assert attacked["on_command_lines"] == [], "the token was on a command line while grading"
    assert TOKEN not in "".join(p.read_text() for p in (attacked["report"] / "feedback").iterdir())


@pytest.mark.slow
def test_a_notebook_that_inflates_when_parsed_is_bounded_and_only_its_students_verdict(attacked):
    grades = attacked["grades"]
    for exercise in ("2.1", "2.2"):
        grade = grades["inflater", exercise]
        assert grade["passed"] == "false" and grade["diagnosis"] in ("missing", "exception"), grade
        assert "MemoryError" in grade["message"], grade
    assert grades["inflater", "1.2"]["diagnosis"] == "not_implemented"


# --- One sandbox, many students in turn (the zygote) --------------------------------------------------------
# A worker's sandbox now grades student after student: each in a fresh child of a worker that imported torch
# once. What one student leaves in the sandbox must be gone before the next one's job reaches it.

VICTIM_MARKER = "bob-private-93d1"   # in the victim's notebook: no other student's process may see it
SPY_TAG = "spy-loop-41c7"            # on the command line of the process the spy leaves behind

# Runs in a process with no audit hook, started by the spy and detached from its exercise, at the end of a
# chain of 40 processes (so a sweep that kills children one level at a time misses it), and once the spy's
# own grading is over it attacks whoever comes next: forged verdicts into every descriptor it can open, the
# next student's files and memory read for their marker (the loot is left in /tmp for a later student), and
# every process but the sandbox's init, the worker and itself killed (a victim would "crash").
SPY_LOOP = f"""
import os, sys, time
tag = {SPY_TAG!r}
marker = {VICTIM_MARKER!r}
def parent(pid):
    return int(open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[1])
chain = [os.getpid()]
while chain[-1] > 1:
    chain.append(parent(chain[-1]))
zygote = chain[-2]                    # the ancestor whose parent is the sandbox's init
spy_student = chain[-3]               # the zygote's child grading the spy
forged = ('{{"type": "grade", "student": "b_victim", "exercise": "1.1", "seconds": 0, "verdict": {{"exercise": '
          '"1.1", "passed": false, "diagnosis": "crashed", "message": "forged"}}}}\\n'
          '{{"type": "done", "student": "b_victim"}}\\n').encode()
os.setsid()
for _ in range(40):                   # a chain, each process waiting on the next: a sweep that kills the
    try:                              # worker's children one level at a time stops before its end
        pid = os.fork()
    except OSError:
        break
    if pid:
        os.waitpid(pid, 0)
        os._exit(0)
deadline = time.time() + 90
while time.time() < deadline:
    if os.path.exists(f"/proc/{{spy_student}}"):
        time.sleep(0.002)
        continue
    loot = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, zygote, os.getpid()):
            continue
        for what in ("environ", "cmdline"):
            try:
                if marker.encode() in open(f"/proc/{{name}}/{{what}}", "rb").read():
                    loot.append(what)
            except OSError:
                pass
        try:
            for fd in os.listdir(f"/proc/{{name}}/fd"):
                try:
                    handle = os.open(f"/proc/{{name}}/fd/{{fd}}", os.O_WRONLY | os.O_NONBLOCK)
                    os.write(handle, forged)
                    os.close(handle)
                except OSError:
                    pass
        except OSError:
            pass
        try:
            os.kill(int(name), 9)
        except OSError:
            pass
    for top, _, files in os.walk("/tmp"):
        for file in files:
            try:
                if marker.encode() in open(os.path.join(top, file), "rb").read():
                    loot.append(os.path.join(top, file))
            except OSError:
                pass
    try:
        with open("/tmp/spy-loot.txt", "a") as out:
            out.write(repr(loot) + "\\n")
    except OSError:
        pass
    time.sleep(0.002)
"""

# Run by the spy's first exercise with no audit hook: the zygote's memory, descriptors and environment. The
# spy's exercise process was forked from the zygote, so the zygote maps its heap where the spy's own map says.
READ_ZYGOTE = """
import os, sys
def parent(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
chain = [os.getpid()]
while chain[-1] > 1:
    chain.append(parent(chain[-1]))
zygote = chain[-2]
start, end = (int(x, 16) for x in sys.argv[1].split("-"))
got = []
try:
    with open(f"/proc/{zygote}/mem", "rb", buffering=0) as mem:
        mem.seek(start)
        if mem.read(min(4096, end - start)):
            got.append("mem")
except OSError:
    pass
for what in ("environ", "maps"):
    try:
        if open(f"/proc/{zygote}/{what}", "rb").read():
            got.append(what)
    except OSError:
        pass
try:
    os.listdir(f"/proc/{zygote}/fd")
    got.append("fd")
except OSError:
    pass
open(sys.argv[2], "w").write(",".join(got))
"""

# Run by a later student with no audit hook: is any process of the spy's still there, any file it planted?
LOOK_AROUND = f"""
import os, sys
found = []
for name in os.listdir("/proc"):
    if name.isdigit() and int(name) != os.getpid():   # this process's own command line holds the tag
        try:
            if {SPY_TAG!r}.encode() in open(f"/proc/{{name}}/cmdline", "rb").read():
                found.append("spy process " + name)
        except OSError:
            pass
for top, _, files in os.walk("/tmp"):
    found += [os.path.join(top, f) for f in files if f.startswith(("spy-loot", "planted_probe_41"))]
open(sys.argv[1], "w").write(", ".join(found))
"""


def _unhooked(code: str, args: str = "") -> str:
    """An attack body: run ``code`` in a fresh interpreter (no audit hook) with argv ``[*args, out]``, wait for
    it, and return what it wrote into ``out`` (None when it wrote nothing: nothing got through)."""
    return (f"out = os.path.join(os.getcwd(), 'found-' + str(time.time_ns()))\n"
            "try:\n"
            f"    pid = _spawn([sys.executable, '-c', {code!r}{args}, out])\n"
            "except PermissionError:\n"   # the sandbox refuses fork_exec too now: nothing got through
            "    return None\n"
            "os.waitpid(pid, 0)\n"
            "if not os.path.exists(out):\n    return 'the unhooked process did not run'\n"
            "return open(out).read() or None\n")


def _zygote_attacks() -> dict[str, dict[str, str]]:
    return {
        "a_spy": {
            # the zygote's memory (where the spy's own map puts its heap: both were forked from it), its
            # descriptors and its environment: none readable, since it is not dumpable
            "1.1": "maps = open('/proc/self/maps').read().splitlines()\n"
                   "region = next(line.split()[0] for line in maps if '[heap]' in line or ' rw-p ' in line)\n"
                   + _unhooked(READ_ZYGOTE, ", region"),
            # a module planted where the next student's interpreter might import it, and a file for later
            "1.2": ("_spawn(['/bin/sh', '-c', 'echo \"raise SystemExit(7)\" > /tmp/planted_probe_41.py; "
                    "echo x > /tmp/spy-loot-planted.txt'])\ntime.sleep(1)\nreturn None\n"),
            # a process left behind that attacks whoever the sandbox grades next
            "1.3": f"_spawn([sys.executable, '-c', {SPY_LOOP!r}, {SPY_TAG!r}])\ntime.sleep(1)\nreturn None\n",
        },
        "c_collector": {
            # what the spy left: a process of its, its loot, its planted module
            "1.1": ("import importlib.util\nif importlib.util.find_spec('planted_probe_41') is not None:\n"
                    "    return 'the planted module is importable'\n" + _unhooked(LOOK_AROUND)),
        },
    }


@pytest.fixture(scope="module")
def one_sandbox(tmp_path_factory):
    """A spy, its victim, a later student and a learner, graded in turn in ONE sandbox (one worker)."""
    root = tmp_path_factory.mktemp("zygote")
    submissions, report = root / "class", root / "report"
    for student, attacks in _zygote_attacks().items():
        write_student(submissions / student, ["01"], {ex: _cell(ex, attack) for ex, attack in attacks.items()})
    write_student(submissions / "b_victim", ["01"], solved=True)
    victim = submissions / "b_victim" / "01_attention_toy.ipynb"
    victim.write_text(victim.read_text().replace("Toy attention", f"Toy attention {VICTIM_MARKER}", 1))
    write_student(submissions / "d_learner", ["01"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(course_lib.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "course_lib", "grade", str(submissions), "--out", str(report),
                           "--workers", "1", "--exercises", "1.1,1.2,1.3", "--timeout", "60",
                           "--isolation", "on", "--quiet"], capture_output=True, text=True, env=env, timeout=600,
                          start_new_session=True)
    rows = list(csv.DictReader(io.StringIO((report / "grades.csv").read_text()))) \
        if (report / "grades.csv").exists() else []
    return {"done": done, "report": report, "grades": {(r["student"], r["exercise"]): r for r in rows}}


@pytest.mark.slow
def test_a_process_left_by_one_student_never_meets_the_next(one_sandbox):
    """The spy's process is gone before the victim's job enters the sandbox: no forged or crashed grade for
    the victim, no marker of theirs anywhere, nothing of the spy's (process, loot, module) for the next."""
    done, grades = one_sandbox["done"], one_sandbox["grades"]
    assert done.returncode == 0, done.stderr[-3000:]
    for exercise in ("1.1", "1.2", "1.3"):
        assert grades["b_victim", exercise]["passed"] == "true", grades["b_victim", exercise]
        assert grades["d_learner", exercise]["diagnosis"] == "not_implemented", grades["d_learner", exercise]
    assert grades["c_collector", "1.1"]["passed"] == "true", grades["c_collector", "1.1"]["message"]
    report = one_sandbox["report"]
    written = (report / "grades.csv").read_text() + "".join(p.read_text() for p in (report / "feedback").iterdir())
    assert VICTIM_MARKER not in written and "forged" not in written


@pytest.mark.slow
def test_a_student_cannot_read_the_zygotes_memory_descriptors_or_environment(one_sandbox):
    grade = one_sandbox["grades"]["a_spy", "1.1"]
    assert grade["passed"] == "true", grade   # the attack read nothing, then the right answer


def test_one_sandbox_grades_student_after_student(tmp_path, monkeypatch):
    """Isolated, a worker's sandbox serves every student it is handed (the zygote forks one child per student),
    not one sandbox per student; honest students' grades are what they are alone."""
    from course_lib.classroom.grading import grade, pool
    started, events = [], []
    original, original_stop = pool._Worker.__init__, pool._Worker.stop

    def counted(self, exercises, options, number, *, checked=True):
        started.append((options.isolated, checked))
        events.append(("start", checked))
        self.checked_ = checked
        original(self, exercises, options, number, checked=checked)

    def stopped(self, *args, **kwargs):
        events.append(("stop", self.checked_))
        original_stop(self, *args, **kwargs)

    monkeypatch.setattr(pool._Worker, "__init__", counted)
    monkeypatch.setattr(pool._Worker, "stop", stopped)
    for name in ("ann", "ben", "cat"):
        write_student(tmp_path / "class" / name, ["01"], solved=name != "ben")
    run = grade(tmp_path / "class", tmp_path / "report", workers=1, exercises=["1.1", "1.2", "1.3"], isolate=True)
    assert started == [(False, False), (True, True)], started
    # One slot (Gradescope's 768 MB): the self-check's worker has stopped before the grading worker starts.
    assert events.index(("stop", False)) < events.index(("start", True)), events
    passed = {(g.student, g.exercise): g.passed for g in run.grades}
    assert all(passed[s, ex] for s in ("ann", "cat") for ex in ("1.1", "1.2", "1.3")), run.grades
    assert not any(passed["ben", ex] for ex in ("1.1", "1.2", "1.3")), run.grades


_SWEEP_PROBE = r"""
import os, subprocess, sys, time
from course_lib.classroom.grading import zygote
assert zygote.alone_in_sandbox(), sorted(os.listdir("/proc"))
before = sorted(os.listdir("/dev"))
# What one student could leave for the next: a process, and files in every folder it can write here
# (a grader that is not root leaves bubblewrap's /dev, /dev/shm among it, writable by the students' user).
child = os.fork()
if child == 0:
    for path in ("/tmp/planted.py", "/dev/shm/planted", "/dev/planted"):
        with open(path, "w") as out:
            out.write("for the next student")
    os.makedirs("/dev/shm/nested/deeper")
    os.symlink("/etc/passwd", "/dev/shm/link")
    subprocess.Popen(["sleep", "60"], start_new_session=True)
    # SysV objects, which outlive their process: a 1 MB segment (memory held past --memory-mb), a queue, a set
    import ctypes
    libc = ctypes.CDLL(None)
    for made in (libc.shmget(0, 1 << 20, 0o1600), libc.msgget(0, 0o1600), libc.semget(0, 1, 0o1600)):
        assert made >= 0, ctypes.get_errno()
    os._exit(0)
os.waitpid(child, 0)
assert os.path.exists("/dev/shm/planted") and os.path.exists("/dev/planted")
assert all(zygote._ipc_ids(kind) for kind in ("shm", "msg", "sem")), "no SysV object was made"
assert zygote.sweep(), "the sweep failed"
assert not any(zygote._ipc_ids(kind) for kind in ("shm", "msg", "sem")), "a SysV object outlived the sweep"
left = [p for p in ("/tmp/planted.py", "/dev/shm/planted", "/dev/planted", "/dev/shm/nested", "/dev/shm/link")
        if os.path.lexists(p)]
assert left == [], left
assert sorted(os.listdir("/dev")) == before, (before, sorted(os.listdir("/dev")))
assert [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid())] == []
print("SWEPT")
"""


def test_the_sweep_between_students_empties_every_folder_a_student_can_write():
    """What a student leaves in /tmp, /dev or /dev/shm, any process it started and any SysV object it made are
    gone before the next student; /dev is back to its device nodes (run in a sandbox as the grader makes one)."""
    package_root = str(Path(course_lib.__file__).resolve().parents[1])
    done = subprocess.run(
        ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
         "--tmpfs", "/tmp", *[arg for path in sorted({package_root, sys.prefix}) for arg in ("--ro-bind", path, path)],
         "--setenv", "PYTHONPATH", package_root, sys.executable, "-c", _SWEEP_PROBE],   # (a checkout under /tmp too)
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "SWEPT" in done.stdout, done.stdout + done.stderr[-3000:]
