"""Speculative decoding pieces independent of the engine's decode loop: acceptance, a
one-layer EAGLE-style drafter, its online training, adaptive control and a reference loop
(docs/engines.md, "Speculative decoding (pieces)"). The package imports nothing, so the
config check's `speculative.settings` pulls in no transformers (2 s a process): import the
pieces from their modules."""
