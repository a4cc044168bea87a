"""Imported by Python at start-up when this folder is on PYTHONPATH (tests/gpu_machine.py
puts it there): the packages named in $ASYNCFP8_GPU_MACHINE_HIDDEN become invisible, as
on the GPU machine, which does not have them. Child processes inherit the variable and
the path, so a test's subprocesses (pytest, torchrun, the benches) see the same.

The path finder of `sys.meta_path` is replaced by one that does not find the hidden
top-level modules and does not list the hidden distributions' metadata: `import numba`
raises ModuleNotFoundError, `importlib.util.find_spec("numba")` is None and
`importlib.metadata.version("numba")` raises PackageNotFoundError, as where it is not
installed (transformers and torch probe optional packages those ways).
"""

import json
import os
import re
import sys
from importlib.machinery import PathFinder


class GPUMachineFinder:
    """PathFinder, blind to what the GPU machine lacks."""

    def __init__(self, modules, distributions):
        self.modules = frozenset(modules)
        self.distributions = frozenset(distributions)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.modules:
            return None
        return PathFinder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        for distribution in PathFinder.find_distributions(*args, **kwargs):
            name = re.sub(r"[-_.]+", "-", distribution.metadata["Name"] or "").lower()
            if name not in self.distributions:
                yield distribution

    def invalidate_caches(self):
        PathFinder.invalidate_caches()


def install() -> None:
    hidden = json.loads(os.environ["ASYNCFP8_GPU_MACHINE_HIDDEN"])
    finder = GPUMachineFinder(hidden["modules"], hidden["distributions"])
    sys.meta_path[:] = [finder if entry is PathFinder else entry for entry in sys.meta_path]
    if finder not in sys.meta_path:
        raise RuntimeError("tests/gpu_machine_site: no PathFinder in sys.meta_path to replace")


if os.environ.get("ASYNCFP8_GPU_MACHINE_HIDDEN"):
    install()
