"""Hydra config groups (a package so that Hydra can find them as `pkg://asyncfp8.conf`)."""
