"""python -m asyncfp8.worker [overrides...]: one rollout worker."""

from asyncfp8 import exit_on_version_flag
from asyncfp8.worker.loop import main

if __name__ == "__main__":
    exit_on_version_flag()
    main()
