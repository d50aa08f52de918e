"""tests/scheduling.py finds the tests that share a module fixture (make tests-all sends them to one worker)."""
from __future__ import annotations

import pytest
from scheduling import shared_fixtures


@pytest.fixture(scope="module")
def built_once():
    return object()


@pytest.fixture
def uses_it(built_once):
    return built_once


def test_a_test_asking_for_its_modules_fixture_is_grouped(request, built_once):
    assert shared_fixtures(request.node) == ["built_once"]


def test_a_fixture_asked_for_through_another_counts_too(request, uses_it):
    assert shared_fixtures(request.node) == ["built_once"]


def test_function_fixtures_and_autouse_ones_do_not_group(request, tmp_path):
    # conftest's autouse fixtures are function-scoped and from another file: neither is this module's to share
    assert shared_fixtures(request.node) == []
