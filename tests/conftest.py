"""Shared test set-up: no test reads or writes the real per-user data folder."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def isolated_user_data_dir(tmp_path, monkeypatch):
    """Point course_lib's per-user corpus folder at an empty temporary folder for each test."""
    folder = tmp_path / "user-data"
    monkeypatch.setattr("course_lib.corpora.user_data_dir", lambda: folder)
    return folder
