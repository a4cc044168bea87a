"""Hard limits on what a receiver accepts, and the one exception every rejection raises."""

from __future__ import annotations

from dataclasses import dataclass


class RejectedMessage(ValueError):
    """A message that failed validation; the receiver logs the reason and goes on."""


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 1 << 30  # also set as ZMQ_MAXMSGSIZE on receiving sockets
    max_header_bytes: int = 16 << 20
    max_tensors: int = 1 << 16  # per message
    max_ndim: int = 8
    max_chunks: int = 1 << 16  # per version
    max_tokens: int = 1 << 20  # per trajectory
