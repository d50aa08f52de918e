"""A twelfth attack on the grader (2026-11-30): what a student's code or folder can make the grader do.

- The submission was read by path after the walk that skipped links: a student who can still write their folder
  swapped a subfolder for a link between the two (renameat2 RENAME_EXCHANGE), and the grader, as root, read another
  user's file into the submission, or hung the whole run on a FIFO. Each file is opened now one component at a
  time, no link followed, without blocking, and read only if it is a regular file.
- Extended attributes and epoll watches held kernel memory past the memory limit: setxattr is refused by the
  kernel, and an exercise's process has few descriptors (so few watches).
- torch.compile ran the course's reference as rewritten bytecode, which the reference guard does not see.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from sandboxed_judge import judged_in_sandbox

from course_lib.classroom.grading import submissions

LINUX = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")


def _swapped_after_the_walk(monkeypatch, tmp_path: Path, target: str) -> Path:
    """A student's folder whose d/secret.txt is, once walked, a link to another user's folder holding ``target``."""
    other = tmp_path / "other"
    other.mkdir()
    if target == "fifo":
        os.mkfifo(other / "secret.txt")
    else:
        (other / "secret.txt").write_text("VICTIM-SECRET")
    student = tmp_path / "class" / "ada"
    (student / "d").mkdir(parents=True)
    (student / "01_intro.ipynb").write_text("{}")
    (student / "d" / "secret.txt").write_text("my own file")
    walk = submissions._walk

    def walk_then_swap(*args, **kwargs):
        found = walk(*args, **kwargs)
        if not (student / "d").is_symlink():   # as renameat2 RENAME_EXCHANGE does, between the walk and the read
            (student / "d").rename(student / "d.old")
            (student / "d").symlink_to(other)
        return found

    monkeypatch.setattr(submissions, "_walk", walk_then_swap)
    return tmp_path / "class"


@pytest.mark.skipif(not LINUX, reason="O_NOFOLLOW and dir_fd are POSIX's")
@pytest.mark.parametrize("target", ["secret", "fifo"])
def test_a_folder_swapped_for_a_link_after_the_walk_is_not_read(target, monkeypatch, tmp_path):
    folder = _swapped_after_the_walk(monkeypatch, tmp_path, target)
    found: list = []
    reader = threading.Thread(target=lambda: found.extend(submissions.find_submissions(folder)), daemon=True)
    reader.start()
    reader.join(20)
    assert found, "the read of the submissions hung (a FIFO behind a link)"
    (ada,) = found
    assert "d/secret.txt" not in ada.files and "01_intro.ipynb" in ada.files, ada.files
    assert any(note.startswith("d/secret.txt skipped: a link") for note in ada.notes), ada.notes


@pytest.mark.skipif(not LINUX, reason="O_NONBLOCK and fstat as POSIX has them")
def test_a_file_swapped_for_a_fifo_after_the_walk_is_skipped_without_waiting(monkeypatch, tmp_path):
    student = tmp_path / "class" / "ada"
    student.mkdir(parents=True)
    (student / "01_intro.ipynb").write_text("{}")
    (student / "notes.txt").write_text("mine")
    walk = submissions._walk

    def walk_then_swap(*args, **kwargs):
        found = walk(*args, **kwargs)
        if not (student / "notes.txt").is_fifo():
            (student / "notes.txt").unlink()
            os.mkfifo(student / "notes.txt")
        return found

    monkeypatch.setattr(submissions, "_walk", walk_then_swap)
    found: list = []
    reader = threading.Thread(target=lambda: found.extend(submissions.find_submissions(tmp_path / "class")),
                              daemon=True)
    reader.start()
    reader.join(20)
    assert found, "the read of the submissions hung on a FIFO"
    assert "notes.txt skipped: not a regular file" in found[0].notes, found[0].notes


@pytest.mark.skipif(not LINUX, reason="seccomp filters and resource limits are Linux's")
def test_extended_attributes_are_refused_and_descriptors_few_in_an_exercise_process(tmp_path):
    """A tmpfs's extended attributes held 1.5 GB of kernel memory under a 384 MB limit; epoll watches 1.1 GB, with
    4000 descriptors each watched by 4000 instances (1024 descriptors: about 257k watches, 49 MB)."""
    script = ("import os, resource\n"
              "from course_lib.classroom.grading import sandbox\n"
              "open('probe', 'w').close()\n"
              "os.setxattr('probe', 'user.before', b'x')   # the file system takes them\n"
              f"sandbox.enter({str(tmp_path)!r}, [], memory_mb=None, cpu_seconds=None)\n"
              "said = []\n"
              "for name, call in (('setxattr', os.setxattr), ('lsetxattr', lambda *a: os.setxattr(*a, follow_symlinks=False)),\n"
              "                   ('fsetxattr', lambda p, *a: os.setxattr(os.open(p, os.O_RDONLY), *a))):\n"
              "    try:\n"
              "        call('probe', 'user.' + name, b'x' * 100); said.append(name + '=allowed')\n"
              "    except PermissionError:\n"
              "        said.append(name + '=refused')\n"
              "said.append(f'nofile={resource.getrlimit(resource.RLIMIT_NOFILE)[1]}')\n"
              "open('said.txt', 'w').write(' '.join(said))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    if "Operation not supported" in done.stderr:
        pytest.skip("this file system has no user extended attributes")
    assert done.returncode == 0, done.stderr[-2000:]
    said = (tmp_path / "said.txt").read_text().split()
    assert said[:3] == ["setxattr=refused", "lsetxattr=refused", "fsetxattr=refused"], said
    assert int(said[3].split("=")[1]) <= 1024, said


COMPILED = ("import course_lib.attention as _A\n\n"
            "_compiled = torch.compile(_A.causal_mask, backend='eager', fullgraph=True, dynamic=False)\n\n"
            "def causal_mask(length):\n    return _compiled(length)\n")
DYNAMO = ("import course_lib.attention as _A\nimport torch._dynamo as _d\n\n"
          "_compiled = _d.optimize('eager')(_A.causal_mask)\n\n"
          "def causal_mask(length):\n    return _compiled(length)\n")
TRAIN_STEP = ("import torch.nn.functional as F\n\n"
              "def train_step(model, optimizer, inputs, targets, max_grad_norm=1.0):\n    model.train()\n"
              "    optimizer.zero_grad()\n    logits = model(inputs)\n"
              "    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))\n"
              "    loss.backward()\n    if max_grad_norm is not None:\n        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)\n"
              "    optimizer.step()\n    return loss.item()\n")


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the sandbox as a forked exercise's process enters it")
@pytest.mark.parametrize("exercise,source,expected", [
    ("2.1", COMPILED, (False, "exception")), ("2.1", DYNAMO, (False, "exception")),
    ("5.3", TRAIN_STEP, (True, None)),
], ids=["torch-compile", "dynamo-optimize", "an-optimizer-still-steps"])
def test_torch_compile_is_refused_in_an_exercises_process(exercise, source, expected, tmp_path):
    """Dynamo runs the course's reference as rewritten bytecode, which fires no call event for the reference guard."""
    verdict, = judged_in_sandbox(tmp_path, exercise, [source])
    assert (verdict["passed"], verdict["diagnosis"]) == expected, verdict
    if not expected[0]:
        assert "torch.compile is not available while grading" in verdict["message"], verdict
