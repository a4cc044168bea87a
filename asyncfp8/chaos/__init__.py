"""Fault injection against the real learner and workers (`tests/reliability/`,
`bench/chaos.py`, docs/reliability.md).

- `cluster`: start a learner and workers as processes on loopback, kill, pause, resume.
- `attacks`: what a broken network or a hostile peer sends: corrupted, truncated,
  oversized and replayed frames, raw TCP garbage, a corrupting relay in front of the
  weights, a rogue publisher.
- `audit`: reads a run back (the learner's ledger and last checkpoint, the logs) and
  says what was lost, trained twice, or left half done.
- `scenarios`: the five faults of docs/reliability.md, each returning a `FaultReport`.
"""
