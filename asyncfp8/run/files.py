"""The names a run gives its checkpoints in `run.dir`, in a module that imports nothing,
so that the launcher, the export, the audit and the learner agree on them without
importing one another (the launcher needs these names, not the learner's torch and
transformers)."""

CHECKPOINT_DIR = "checkpoints"
LEARNER_STATE = "learner.pt"  # in a checkpoint directory, beside the sharded model and optimizer
# The newest version number ever used in this run dir, written before the version goes
# out. A learner killed after its last checkpoint may have published beyond it (or died
# halfway through sending one), and workers ignore a version number they have passed: a
# resumed learner numbers its versions after this one.
LATEST_VERSION_FILE = "latest_version"
# Written by a learner the guard stopped (`guard.max_rollbacks` rollbacks in a row): the
# step, the signal and the checkpoint left. A stopped run is an outcome a study must count
# (asyncfp8.report's summary and its groups' "stopped by the guard"), not a run to
# repeat; a learner resumed in the run dir removes it.
GUARD_STOP_FILE = "guard_stop.json"
# The exit status of a run the guard stopped: not a crash (1), not a bad setting (2), not
# a signal (128 + n).
GUARD_STOPPED = 3
