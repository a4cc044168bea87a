"""asyncfp8: asynchronous off-policy RL for LLMs with pluggable rollout precision."""

import sys
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("asyncfp8")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "unknown"


def exit_on_version_flag() -> None:
    """`--version` on a command line: the version said, and the process done (before Hydra,
    whose own --version names Hydra's)."""
    if "--version" in sys.argv[1:]:
        print(f"asyncfp8 {__version__}")
        raise SystemExit(0)
