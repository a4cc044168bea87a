"""The GPU machine's Python packages, for tests that stand in for it on the CPU.

A lent GPU machine starts bare with a fixed set of packages and no package registry
(../shared/gpu/README.md, "What is there"); a few more travel with the checkout as wheels
(`.gpu/`, installed by bench/gpu.sh). `machine_env()` gives a subprocess environment in
which every other installed package is invisible, as it is there: its imports fail and
its metadata is gone (`gpu_machine_site/sitecustomize.py` does the hiding). When the
project starts importing a package that is not in these lists, the tests run under this
environment fail: add the package to the GPU machine's wheels (and here), or make its
import lazy with a fallback.
"""

from __future__ import annotations

import json
import os
import re
import sys
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

# What the GPU machine has installed: ../shared/gpu/README.md, "What is there". Keep this
# list as that file says; each one's own dependencies are added from its metadata.
ON_THE_GPU_MACHINE = (
    "torch",
    "transformers",
    "triton",
    "safetensors",
    "msgpack",
    "xxhash",
    "tqdm",
    "matplotlib",
    "PyYAML",
    "pytest",
    "pytest-timeout",
    "hypothesis",
    "accelerate",
    "numpy",  # torch's and transformers' own
    "pip",  # come with Python there: bench/gpu.sh installs the wheels with pip
    "setuptools",
)
# The wheels that travel with a run (../shared/gpu/wheels/, copied into .gpu/).
CARRIED_WHEELS = ("pyzmq", "hydra-core", "omegaconf", "antlr4-python3-runtime", "zstandard")
# The project itself runs from the source tree there (PYTHONPATH); its dependencies are
# what the lists above must cover, so they are not added from its metadata.
PROJECT = ("asyncfp8",)

SITE = Path(__file__).resolve().parent / "gpu_machine_site"
HIDDEN_VARIABLE = "ASYNCFP8_GPU_MACHINE_HIDDEN"


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def with_dependencies(names) -> set[str]:
    """The distributions `names` and everything they require (extras left out), as far as
    they are installed here."""
    seen: set[str] = set()
    todo = [normalized(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(normalized(requirement.name))
    return seen


@cache
def hidden() -> dict[str, list[str]]:
    """{"modules": top-level import names, "distributions": names} of what is installed
    here and not on the GPU machine."""
    allowed = with_dependencies((*ON_THE_GPU_MACHINE, *CARRIED_WHEELS)) | set(PROJECT)
    modules = {
        module
        for module, distributions in metadata.packages_distributions().items()
        if "/" not in module and not any(normalized(d) in allowed for d in distributions)
    }
    distributions = {normalized(d.metadata["Name"]) for d in metadata.distributions()}
    return {
        "modules": sorted(modules - set(sys.stdlib_module_names)),
        "distributions": sorted(distributions - allowed),
    }


def machine_env(env: dict[str, str] | None = None, repo: Path | None = None) -> dict[str, str]:
    """`env` (default: this process's) for a Python subprocess that sees only the GPU
    machine's packages, with `repo` (default: this checkout) first on its path."""
    env = dict(os.environ if env is None else env)
    repo = repo or Path(__file__).resolve().parent.parent
    paths = [str(SITE), str(repo), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[HIDDEN_VARIABLE] = json.dumps(hidden())
    return env
