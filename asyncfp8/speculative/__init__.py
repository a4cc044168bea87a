"""Speculative decoding pieces that do not depend on the engine's decode loop."""
