"""Fault injection against the real learner and workers (`tests/reliability/`,
`bench/chaos.py`, docs/reliability.md): `cluster` starts, kills, pauses and resumes them on
loopback; `attacks` sends what a broken network or a hostile peer would; `audit` reads a
run back and says what was lost, trained twice or left half done; `scenarios` runs the
faults of docs/reliability.md, each returning a `FaultReport`."""
