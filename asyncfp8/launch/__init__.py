"""One command for a run (`python -m asyncfp8.launch`): the local launcher and its child
processes, the Ray driver, the task under Slurm, the progress bar and the ending report."""
