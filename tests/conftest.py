"""Shared test set-up: no test reads or writes the real per-user data folder."""
from __future__ import annotations

import pytest
from scheduling import (  # noqa: F401  (how xdist spreads the tests: tests/scheduling.py)
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
)


@pytest.fixture(autouse=True)
def isolated_user_data_dir(tmp_path, monkeypatch):
    """Point course_lib's per-user corpus folder at an empty temporary folder for each test."""
    folder = tmp_path / "user-data"
    monkeypatch.setattr("course_lib.corpora.user_data_dir", lambda: folder)
    return folder


@pytest.fixture(autouse=True)
def no_remembered_checks():
    """checks.hint and show_solution follow the last check of an exercise in this process: start each
    test with none, as a fresh kernel does."""
    from course_lib.classroom.checks.engine import run
    run.forget()
    yield
    run.forget()


@pytest.fixture
def unguarded(monkeypatch):
    """For a test whose candidate is built on the course's reference on purpose (a subclass that only
    changes the constructor, a wrapper that perturbs the reference's output) to reach another verdict:
    the reference guard, which would rightly call it ``calls_reference``, is not what it tests."""
    from contextlib import nullcontext

    from course_lib.classroom.checks.engine import run
    # on the run's own name: a check puts course_lib's modules back as they were, but not checks' own
    monkeypatch.setattr(run, "_guard", lambda exercise, args: nullcontext())


@pytest.fixture(params=["forked", "in process"])
def check_process(request, monkeypatch):
    """Each check of the test both ways it can run: in a forked child (Linux) and in the kernel's own process
    (macOS, Windows, CUDA; COURSE_CHECK_IN_PROCESS=1)."""
    if request.param == "in process":
        monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")
    return request.param
