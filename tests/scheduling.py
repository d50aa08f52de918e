"""How `make tests-all` spreads the tests over its pytest-xdist workers (``--dist loadgroup``).

- Tests that share a module-scoped fixture of their own module (a venv built by README's commands, the
  Gradescope archive set up by its setup.sh, a graded class, nbgrader's course) go to one worker as one
  unit, so that the fixture is built once. Spread over two workers, as ``--dist worksteal`` did, each
  worker built it again: the same minutes of CPU twice.
- Modules holding a slow test run first, so that the last tests to start are short ones and neither
  worker waits long for the other at the end. A module's tests stay together and in their order, so that
  one process never builds a module fixture twice either.

- Each worker runs torch on one thread: two workers on two cores, not four threads spinning for two.

None of these changes what a test runs or asserts; only where, when and on how many threads.

xdist's own loadgroup reads ``xdist_group`` marks by renaming each test's node id, which pytest 9 no
longer allows (the marks are ignored there); so the workers, which see each test's fixtures, write the
groups to a file, and the controller's scheduler (xdist's loadscope, one unit per group and one per
other test) reads it.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

GROUPS_ENV = "COURSE_XDIST_GROUPS"   # the file the workers write {node id: group} to


def shared_fixtures(item: pytest.Item) -> list[str]:
    """The module-scoped fixtures defined in ``item``'s own module that it asks for (directly or not)."""
    module = item.nodeid.split("::")[0]
    info = getattr(item, "_fixtureinfo", None)   # a doctest or a notebook cell has none
    if info is None:
        return []
    # (an autouse one, such as test_bench's thread setting, is cheap and is used by every test: left out)
    return [name for name, definitions in info.name2fixturedefs.items()
            if definitions[-1].scope in ("module", "package", "session") and definitions[-1].baseid == module
            and not getattr(definitions[-1], "_autouse", False)]


def _loadgroup(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") == "loadgroup"


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        # one worker per core: with torch's default (a thread per core) in each, the workers' threads spin
        # waiting for each other, and tests that train ran up to 10 times slower under load than alone.
        # A test about threads sets its own count.
        import torch
        torch.set_num_threads(1)
    if not hasattr(config, "workerinput") and _loadgroup(config):   # the controller, before it starts workers
        os.environ[GROUPS_ENV] = str(Path(tempfile.mkdtemp(prefix="course-xdist-")) / "groups.json")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    slow_first = sorted(modules.values(), key=lambda tests: not any(t.get_closest_marker("slow") for t in tests))
    items[:] = [item for tests in slow_first for item in tests]
    target = os.environ.get(GROUPS_ENV)
    if target and hasattr(config, "workerinput"):   # a worker: every worker writes the same groups
        groups = {item.nodeid: item.nodeid.split("::")[0] for item in items if shared_fixtures(item)}
        partial = Path(f"{target}.{os.getpid()}")
        partial.write_text(json.dumps(groups))
        os.replace(partial, target)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if not _loadgroup(config):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FixtureGroups(LoadScopeScheduling):
        """One unit per group of tests sharing a module fixture, one per other test; the larger units first."""
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:   # read once every worker has collected (and written the file)
                path = Path(os.environ.get(GROUPS_ENV, ""))
                self.groups = json.loads(path.read_text()) if path.is_file() else {}
            return self.groups.get(nodeid, nodeid)

    return FixtureGroups(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    target = os.environ.get(GROUPS_ENV)
    if target and not hasattr(config, "workerinput"):
        Path(target).unlink(missing_ok=True)
        Path(target).parent.rmdir()
