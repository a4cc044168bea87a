"""python -m asyncfp8.launch [overrides...]: a run on this machine, Ray or Slurm."""

from asyncfp8 import exit_on_version_flag
from asyncfp8.launch.local import main

if __name__ == "__main__":
    exit_on_version_flag()
    main()
