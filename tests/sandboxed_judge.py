"""Judge submissions of one exercise in a fresh process that has entered the grader's sandbox, as an exercise's
process does (its policy, its limits, its streams closed), without the worker around it: the attack tests' harness."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def judged_in_sandbox(folder: Path, exercise: str, sources: list[str]) -> list[dict]:
    """The judge's verdict on each of ``sources`` for ``exercise``, one after another in one sandboxed process whose
    working folder is ``folder``."""
    script = ("import json\n"
              "from course_lib.classroom.grading import grading_plan, sandbox\n"
              "from course_lib.classroom.grading.judge import judge, course_namespace\n"
              "from course_lib.classroom.checks._references import bind_references\n"
              f"plan = grading_plan([{exercise!r}])[{exercise!r}]\n"
              "course_namespace()\n"
              "bind_references(checkers_too=True)\n"
              f"sandbox.enter({str(folder)!r}, [], memory_mb=None, cpu_seconds=None)\n"
              f"verdicts = [judge(plan, source) for source in {sources!r}]\n"
              "open('verdicts.json', 'w').write(json.dumps(verdicts))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=folder)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((folder / "verdicts.json").read_text())
