"""Shared test set-up: no test reads or writes the real per-user data folder."""
from __future__ import annotations

import pytest


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
    from course_lib.classroom.checks import _counterexample
    _counterexample.forget()
    yield
    _counterexample.forget()
