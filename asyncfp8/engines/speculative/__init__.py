"""Speculative decoding pieces that do not depend on the engine's decode loop: lossless
acceptance, a one-layer EAGLE-style drafter, its online training from the target's
rollouts, adaptive control (when to speculate, how many tokens to draft), and a reference
decode loop that puts them together (docs/engines.md, "Speculative decoding (pieces)").

The package itself imports nothing: `speculative.settings`, which every process's config
check reads, must not pull in the decode loop's transformers (2 s a process); import
the pieces from their modules."""
