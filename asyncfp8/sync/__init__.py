"""Policy versions (learner -> workers) and trajectories (workers -> learner) over ZeroMQ,
optionally CURVE-authenticated (docs/sync.md).

    messages = encode_version(7, weights.items(), extra, base=previous, base_version=6)
    version = decode_version(messages, base=previous, base_version=6)  # .weights, .extra
"""

from .background import BackgroundPublisher, PublishFailed
from .codec import Version, encode_chunks, encode_version
from .limits import Limits, RejectedMessage
from .security import Curve, HandshakeWatch
from .trajectories import Trajectory, TrajectoryReceiver, TrajectorySender
from .version_decode import VersionAssembler, decode_version
from .version_publisher import PublishStats, VersionPublisher
from .version_subscriber import VersionSubscriber

__all__ = [
    "BackgroundPublisher",
    "Curve",
    "HandshakeWatch",
    "Limits",
    "PublishFailed",
    "PublishStats",
    "RejectedMessage",
    "Trajectory",
    "TrajectoryReceiver",
    "TrajectorySender",
    "Version",
    "VersionAssembler",
    "VersionPublisher",
    "VersionSubscriber",
    "decode_version",
    "encode_chunks",
    "encode_version",
]
