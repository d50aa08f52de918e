"""Gradescope's autograder archive: what it holds, and (slow) the archive at work in a folder laid out as
Gradescope lays out /autograder, set up in a fresh venv by its own setup.sh, grading a solved and a blank
submission under Gradescope's default limits (768 MB, half a CPU, 10 minutes).

Limits: a cgroup (memory.limit_in_bytes 768 MB, cpu.cfs_quota_us half of one CPU) where this machine lets
the test make one (v1 hierarchy, as root); otherwise one CPU (taskset) and 768 MB of data (prlimit).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from course_lib.classroom.exercises import EXERCISES as COURSE_EXERCISES
from course_lib.classroom.grading import autograder
from course_lib.classroom.grading.plan import default_exercises

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("COURSE_DATA_DIR") or ROOT.parent / "shared" / "data")
GRADESCOPE_MB, GRADESCOPE_SECONDS = 768, 600
EXERCISES = ["01", "02"]   # the slow test's assignment: notebooks 01 and 02 (CI time)


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("archive") / "autograder.zip"
    names = autograder.write_autograder(out, ["1.1", "1.2", "2.1", "2.2"])
    assert names[:3] == ["setup.sh", "run_autograder", "autograder.json"]
    return out


def _read(archive: Path, name: str) -> str:
    with zipfile.ZipFile(archive) as z:
        return z.read(name).decode()


def test_the_archive_holds_gradescopes_two_scripts_at_its_root_executable(archive):
    with zipfile.ZipFile(archive) as z:
        infos = {i.filename: i for i in z.infolist()}
    wheel = [n for n in infos if n.endswith(".whl")]
    assert set(infos) == {"setup.sh", "run_autograder", "autograder.json", *wheel} and len(wheel) == 1
    assert wheel[0].startswith("attention_course-")
    for script in ("setup.sh", "run_autograder"):
        assert (infos[script].external_attr >> 16) & 0o111, f"{script} must be executable"
        text = _read(archive, script)
        assert text.startswith("#!/usr/bin/env bash\n")
        checked = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
    config = json.loads(_read(archive, "autograder.json"))
    assert config["exercises"] == ["1.1", "1.2", "2.1", "2.2"]
    notebooks = {exercise.id.split(".")[0] for exercise in COURSE_EXERCISES}   # every notebook with a graded exercise
    assert config["timeout"] * len(notebooks) < GRADESCOPE_SECONDS, \
        f"{len(notebooks)} notebooks of a hostile submission should fit Gradescope's 10 minutes"


def test_setup_installs_cpu_torch_alone_then_the_course_with_its_exact_versions(archive):
    setup = _read(archive, "setup.sh")
    from importlib import metadata
    torch_line = next(line for line in setup.splitlines() if "download.pytorch.org/whl/cpu" in line)
    assert "--no-deps" in torch_line and f'"torch=={metadata.version("torch").split("+")[0]}"' in torch_line
    course_line = next(line for line in setup.splitlines() if "[pinned]" in line)
    assert re.search(r'pip_install "\$SOURCE/attention_course-[\d.]+-py3-none-any\.whl\[pinned\]"', course_line)
    assert setup.index(torch_line) < setup.index(course_line), "torch first, so the course's pin finds it there"
    assert "grep -i '^nvidia-'" in setup and "exit 1" in setup, "a CUDA package installed fails the set-up"


def test_the_command_refuses_what_cannot_work(tmp_path, capsys):
    from course_lib.__main__ import main as course_main

    def run(*args):
        try:
            code = course_main(["autograder", *args])
        except SystemExit as exit:   # argparse's refusal
            code = exit.code
        return subprocess.CompletedProcess(args, code, *capsys.readouterr())
    bad = run(str(tmp_path / "a.tar"))
    assert bad.returncode == 2 and "out: expected a file name ending in .zip" in bad.stderr
    bad = run(str(tmp_path / "a.zip"), "--exercises", "99")
    assert bad.returncode == 2 and "--exercises" in bad.stderr and "'99'" in bad.stderr
    bad = run(str(tmp_path / "missing" / "a.zip"))
    assert bad.returncode == 2 and "expected an existing folder" in bad.stderr
    assert not list(tmp_path.rglob("*.zip*")), "nothing written when refused"


def test_a_submission_that_cannot_be_graded_gets_a_results_json_that_says_why(tmp_path, monkeypatch):
    root = tmp_path / "autograder"
    for folder in ("source", "submission", "results"):
        (root / folder).mkdir(parents=True)
    (root / "source" / "autograder.json").write_text(json.dumps(
        {"exercises": ["1.1"], "timeout": 40.0, "memory_mb": 256}))
    (root / "submission" / "notes.txt").write_text("no notebook here")
    content = autograder.run_autograder(root)
    written = json.loads((root / "results" / "results.json").read_text())
    assert written == content and written["score"] == 0.0 and written["tests"] == []
    assert written["output"].startswith("This submission could not be graded: ")
    assert "no notebook was found in your upload" in written["output"]   # the student's words, not the grader's
    # an archive whose settings are missing or broken: still a results.json (Gradescope shows "no output" else)
    for broken in ("{not json", json.dumps({"exercises": ["1.1"]})):
        (root / "source" / "autograder.json").write_text(broken)
        (root / "results" / "results.json").unlink()
        content = autograder.run_autograder(root)
        assert json.loads((root / "results" / "results.json").read_text()) == content
        assert "the autograder itself is broken" in content["output"] and "tell your instructor" in content["output"]


# --------------------------------------------------------------------------------------------------------
# The archive at work, as on Gradescope
# --------------------------------------------------------------------------------------------------------

class Limits:
    """Gradescope's default container limits around one command, and its peak memory."""

    def __init__(self, name: str):
        self.memory = Path("/sys/fs/cgroup/memory") / name
        self.cpu = Path("/sys/fs/cgroup/cpu") / name
        try:
            self.memory.mkdir()
            self.cpu.mkdir()
            (self.memory / "memory.limit_in_bytes").write_text(str(GRADESCOPE_MB * 2 ** 20))
            (self.memory / "memory.memsw.limit_in_bytes").exists() and \
                (self.memory / "memory.memsw.limit_in_bytes").write_text(str(GRADESCOPE_MB * 2 ** 20))
            (self.cpu / "cpu.cfs_period_us").write_text("100000")
            (self.cpu / "cpu.cfs_quota_us").write_text("50000")   # half of one CPU
            self.how = "cgroup: 768 MB, half a CPU"
        except OSError:
            self.close()
            self.how = "taskset one CPU, prlimit 768 MB of data"

    def wrap(self, argv: list[str]) -> list[str]:
        if self.how.startswith("cgroup"):
            join = (f"echo $$ > {self.memory}/cgroup.procs && echo $$ > {self.cpu}/cgroup.procs && "
                    'exec "$@"')
            return ["sh", "-c", join, "limited", *argv]
        return ["taskset", "-c", "0", "prlimit", f"--data={GRADESCOPE_MB * 2 ** 20}", *argv]

    def peak_mb(self) -> float | None:
        usage = self.memory / "memory.max_usage_in_bytes"
        return int(usage.read_text()) / 2 ** 20 if usage.exists() else None

    def close(self) -> None:
        for folder in (self.memory, self.cpu):
            if folder.is_dir():
                folder.rmdir()


@pytest.fixture(scope="module")
def gradescope(tmp_path_factory):
    """/autograder under a temporary folder: the archive unpacked into source/, set up by its setup.sh."""
    base = tmp_path_factory.mktemp("gradescope")
    root = base / "autograder"
    (root / "source").mkdir(parents=True)
    out = base / "autograder.zip"
    made = subprocess.run([sys.executable, "-m", "course_lib", "autograder", str(out), "--exercises",
                           ",".join(EXERCISES)], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr
    with zipfile.ZipFile(out) as z:
        z.extractall(root / "source")
    for script in ("setup.sh", "run_autograder"):
        (root / "source" / script).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "COURSE_"))}
    env.update(AUTOGRADER_ROOT=str(root), HOME=str(base / "home"), AUTOGRADER_PYTHON=shutil.which("python3.11")
               or sys.executable)
    # PIP_COMPILE=0 for setup.sh's installs only: pip byte-compiles none of the ~13,000 files of torch and the
    # course's dependencies (the test's slowest set-up); what the graded runs import is compiled when imported,
    # inside Gradescope's limits below, which only makes those runs' limits harder to meet, not easier.
    ran = subprocess.run(["bash", str(root / "source" / "setup.sh")], cwd=root / "source", env=dict(env, PIP_COMPILE="0"),
                         capture_output=True, text=True, timeout=1800)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    listed = subprocess.run([str(root / "venv" / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, env=env)
    assert "torch==2.13.0+cpu" in listed.stdout and "nvidia" not in listed.stdout.lower()
    if (SHARED / "tinyshakespeare.txt").is_file():   # what setup.sh downloads on Gradescope
        shutil.copytree(SHARED, root / "data", dirs_exist_ok=True)
    return {"root": root, "env": env}


def _student_files(folder: Path) -> dict[str, str]:
    """A half-done assignment: the first notebook solved (the solution notebook), the others blank (their learner
    copies). One graded run then shows full marks where the work is done and none, with the checker's words,
    where it is not. Returns each notebook number's kind."""
    folder.mkdir(parents=True, exist_ok=True)
    kinds = {number: "solved" if number == EXERCISES[0] else "blank" for number in EXERCISES}
    copies = folder.parent / "copies"
    done = subprocess.run([sys.executable, "-m", "course_lib", "student", str(ROOT / "notebooks"), str(copies)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    for number, kind in kinds.items():
        source, = (ROOT / "notebooks" if kind == "solved" else copies).glob(f"{number}_*.ipynb")
        shutil.copy(source, folder / source.name)
    shutil.rmtree(copies)
    return kinds


def _no_bwrap_path(base: Path) -> str:
    """A PATH with the shells and none of bubblewrap: what a Gradescope container offers."""
    tools = base / "tools"
    tools.mkdir(exist_ok=True)
    for tool in ("bash", "sh", "env", "uname", "id"):
        found = shutil.which(tool)
        if found and not (tools / tool).exists():
            (tools / tool).symlink_to(found)
    return str(tools)


@pytest.mark.slow
def test_the_archive_grades_a_submission_inside_gradescopes_default_limits(gradescope, tmp_path):
    root = gradescope["root"]
    for folder in ("submission", "results"):
        shutil.rmtree(root / folder, ignore_errors=True)
    kinds = _student_files(root / "submission")
    (root / "results").mkdir()
    limits = Limits(f"course-autograder-{os.getpid()}")
    env = dict(gradescope["env"], PATH=_no_bwrap_path(tmp_path))
    try:
        start = time.monotonic()
        ran = subprocess.run(limits.wrap([str(root / "source" / "run_autograder")]), cwd=root, env=env,
                             capture_output=True, text=True, timeout=GRADESCOPE_SECONDS)
        seconds, peak = time.monotonic() - start, limits.peak_mb()
    finally:
        limits.close()
    print(f"{kinds}: {seconds:.1f} s, peak {peak if peak is None else round(peak)} MB ({limits.how})")
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert ran.stdout.count(autograder.CONTAINER_LINE) == 1, ran.stdout
    assert "warning" not in ran.stdout.lower() + ran.stderr.lower()
    results = json.loads((root / "results" / "results.json").read_text())
    wanted = [ex for ex in default_exercises() if int(ex.split(".")[0]) in {int(n) for n in EXERCISES}]
    assert [t["number"] for t in results["tests"]] == wanted
    for test in results["tests"]:
        assert {"name", "score", "max_score", "output", "visibility"} <= set(test)
        assert test["max_score"] == 1.0 and test["visibility"] == "visible"
        if kinds[test["number"].split(".")[0].zfill(2)] == "solved":
            assert test["score"] == 1.0, test
        else:   # the checker's diagnosis and its message, as the student saw it
            assert test["score"] == 0.0, test
            assert re.fullmatch(r"Not yet \([a-z_]+\): \S.*", test["output"], re.S), test["output"]
    solved = [t for t in results["tests"] if kinds[t["number"].split(".")[0].zfill(2)] == "solved"]
    assert 0 < len(solved) < len(wanted) and results["score"] == len(solved), results
