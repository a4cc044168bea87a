"""The rollout worker (`python -m asyncfp8.worker`): its loop, and a lease turned into
scored trajectories (shared with the colocated learner)."""
