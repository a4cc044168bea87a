"""How `make test` splits the suite over two pytest processes (pytest-xdist, `-n 2`;
docs/testing.md) without paying twice for what tests share and without breaking what must
run in order. A pytest plugin, loaded by tests/conftest.py.

- A fixture built once per process and shared by several tests (module-scoped, or one of
  conftest's session-scoped launched runs) would be built once in each process that runs
  one of them. Tests linked by such fixtures form one group: the connected components of
  the tests and the fixtures they share, so each is built once, as in a serial run.
- Every test marked vllm joins one group, the first in the queue: conftest runs them
  before anything loads numba in the process, and a group runs whole, in order, on one
  process.
- The rest go slow-marked first, so that the long runs start early and the short tests
  even out the two processes' ends.

The scheduler is xdist's own by scope (`LoadScopeScheduling`: a scope runs whole on one
process, in order; scopes are handed out in the order of their first test, to whichever
process is running out of work) with each test's scope read from the groups the workers
computed at collection. xdist's `--dist loadgroup` cannot carry them: it renames each
test through an attribute pytest 9.2 no longer reads, so its groups are silently lost.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

# Session-scoped fixtures that every process may build for itself: an import, or a model
# directory both processes share (conftest's tiny_model_dir, under a lock).
PER_PROCESS = frozenset({"vllm_module", "tiny_model_dir", "tmp_path_factory"})
VLLM_GROUP = "vllm"


def shared_fixtures(item: pytest.Item) -> list[str]:
    """Keys of the fixtures `item` shares with other tests of the session: `module::name`
    for a module- or class-scoped fixture, the name for a session-scoped one."""
    keys = []
    # pytest exposes the resolved fixture definitions only on this attribute.
    for name, defs in item._fixtureinfo.name2fixturedefs.items():
        scope = defs[-1].scope
        if scope == "session" and name not in PER_PROCESS:
            keys.append(name)
        elif scope in ("module", "class", "package"):
            keys.append(f"{item.nodeid.split('::')[0]}::{name}")
    return keys


def groups(items: list[pytest.Item]) -> dict[str, str]:
    """nodeid -> group name, for the tests that share a fixture or run vLLM in-process."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    linked = {}
    for item in items:
        keys = shared_fixtures(item)
        if item.get_closest_marker("vllm") is not None:
            keys.append(VLLM_GROUP)
        if keys:
            linked[item.nodeid] = keys[0]
            first = root(keys[0])  # registers it when it is the test's only key
            for key in keys[1:]:
                parent[root(key)] = root(first)
    # one readable name per component: the vllm group's, else its first fixture's
    names: dict[str, str] = {}
    for key in sorted(parent, key=lambda k: k != VLLM_GROUP):
        names.setdefault(root(key), f"group:{key}")  # no test's id starts so
    return {nodeid: names[root(key)] for nodeid, key in linked.items()}


def order(items: list[pytest.Item]) -> None:
    """vLLM first (conftest's reason), then slow, each kept in collection order."""
    items.sort(
        key=lambda item: (
            item.get_closest_marker("vllm") is None,
            item.get_closest_marker("slow") is None,
        )
    )


GROUPS_FILE = "asyncfp8_groups_file"
groups_key = pytest.StashKey[Path]()


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.pluginmanager.has_plugin("xdist"):
        fd, path = tempfile.mkstemp(prefix="asyncfp8-xdist-groups-", suffix=".json")
        os.close(fd)
        config.stash[groups_key] = Path(path)


def pytest_unconfigure(config):
    if groups_key in config.stash:
        config.stash[groups_key].unlink(missing_ok=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Tells each pytest process where to write the groups it computes."""
    node.workerinput[GROUPS_FILE] = str(node.config.stash[groups_key])


@pytest.hookimpl(trylast=True)  # after conftest's own ordering
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):
        return
    order(items)
    # Every process collects the same tests and writes the same groups; the replace is
    # atomic, so the scheduler reads one whole file whichever wrote last.
    target = Path(config.workerinput[GROUPS_FILE])
    partial = target.with_suffix(f".{config.workerinput['workerid']}")
    partial.write_text(json.dumps(groups(items)))
    os.replace(partial, target)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scheduling by scope, each test's scope its group (or itself)."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            # keep the order of the queue: vLLM first, then slow (xdist would sort the
            # scopes by their number of tests)
            config.option.loadscopereorder = False
            self.group_of: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.group_of is None:  # read once every process has collected
                self.group_of = json.loads(config.stash[groups_key].read_text())
            return self.group_of.get(nodeid, nodeid)

    return GroupScheduling(config, log)
