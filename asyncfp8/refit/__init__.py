"""The refit probe that every version passes in the engine before it generates, and the
reference it is held to."""
