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
