"""Versions through shared memory (asyncfp8/sync/shm.py): a worker that falls behind,
a corrupted segment, a learner it cannot reach or that offers none, processes killed
mid-publish; and publishing in the background (asyncfp8/sync/background.py)."""

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from asyncfp8.launch.processes import free_ports
from asyncfp8.precision.manifest import WEIGHT
from asyncfp8.run.failpoints import ENV as FAILPOINTS_ENV
from asyncfp8.sync import BackgroundPublisher, PublishFailed, VersionPublisher, VersionSubscriber

LOOPBACK = "tcp://127.0.0.1:*"


def bits(tensor):
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def model(seed, step):
    """Version `step` of a toy model, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    weights = {f"layer{i}.weight": torch.randn(64, 48, generator=g) * 0.02 for i in range(6)}
    for _ in range(step):
        for tensor in weights.values():
            tensor.add_(torch.randn(tensor.shape, generator=g), alpha=0.001)
    return {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}


def wait_for(subscriber, number, timeout=20.0, at_least=False):
    """The versions applied until the subscriber holds `number` (or, `at_least`, any later
    one: a learner that publishes without pause may be past it by the time a subscriber
    has reconnected, and PUB sockets drop what no subscriber was there to take)."""
    deadline, got = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        version = subscriber.poll(timeout_ms=50)
        if version is not None:
            got.append(version.number)
        held = subscriber.version
        if held == number or (at_least and held is not None and held > number):
            return got
    raise AssertionError(f"subscriber at version {subscriber.version}, waiting for {number}")


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.term()


def pair(context, learner="auto", worker="shm", chunk_bytes=4000):
    publisher = VersionPublisher(
        LOOPBACK, LOOPBACK, chunk_bytes=chunk_bytes, context=context, transport=learner
    )
    subscriber = VersionSubscriber(
        publisher.publish_address, publisher.snapshot_address, context=context, transport=worker
    )
    time.sleep(0.3)
    subscriber.poll(timeout_ms=100)  # the "nothing published yet" reply
    return publisher, subscriber


def test_a_worker_that_falls_behind_gets_the_latest_whole_version(context):
    publisher, subscriber = pair(context)
    try:
        for step in range(5):  # the worker reads nothing meanwhile: 0..2 are overwritten
            publisher.publish(step, model(0, step).items())
        applied = wait_for(subscriber, 4)
        assert applied == sorted(set(applied)) and applied[-1] == 4
        assert subscriber.rejected == 0 and subscriber.transport == "shm"
        assert {k: bits(v) for k, v in subscriber.tensors.items()} == {
            k: bits(v) for k, v in model(0, 4).items()
        }
    finally:
        subscriber.close()
        publisher.close()


def test_a_corrupted_segment_is_refused_and_the_worker_falls_back_to_zeromq(context, caplog):
    publisher, subscriber = pair(context)
    try:
        publisher.publish(0, model(0, 0).items())
        wait_for(subscriber, 0)
        publisher.publish(1, model(0, 1).items())
        segment = publisher.shm.maps[publisher.shm.latest]
        offset = publisher.shm.layout["layer3.weight"]["offset"] + 100
        segment[offset] ^= 0x40  # someone else wrote into the learner's segment
        # The learner's snapshot thread waits on this lock: no snapshot of the spoiled
        # segment goes out before it is repaired below.
        with caplog.at_level(logging.WARNING, logger="asyncfp8.sync"), publisher._lock:
            deadline = time.monotonic() + 10
            while subscriber.fallback_reason is None and time.monotonic() < deadline:
                assert subscriber.poll(timeout_ms=50) is None
            segment[offset] ^= 0x40
        assert subscriber.version == 0  # version 1 was not applied, not even in part
        assert {k: bits(v) for k, v in subscriber.tensors.items()} == {
            k: bits(v) for k, v in model(0, 0).items()
        }
        assert subscriber.transport == "tcp" and "corrupted segment" in subscriber.fallback_reason
        assert "layer3.weight: checksum mismatch" in caplog.text
        assert "receiving versions over ZeroMQ" in caplog.text
        wait_for(subscriber, 1)  # by snapshot over ZeroMQ
        publisher.publish(2, model(0, 2).items())
        wait_for(subscriber, 2)  # and live, as deltas
        assert subscriber.current.transport == "tcp"
        assert {k: bits(v) for k, v in subscriber.tensors.items()} == {
            k: bits(v) for k, v in model(0, 2).items()
        }
    finally:
        subscriber.close()
        publisher.close()


def test_a_worker_that_cannot_reach_the_segments_falls_back_to_zeromq(context, caplog):
    publisher, first = pair(context)
    try:
        publisher.publish(0, model(0, 0).items())
        wait_for(first, 0)
        # As if the worker were on another host, or in another network namespace.
        publisher.shm._server.close()
        late = VersionSubscriber(
            publisher.publish_address, publisher.snapshot_address, context=context, transport="shm"
        )
        with caplog.at_level(logging.WARNING, logger="asyncfp8.sync"):
            wait_for(late, 0)
        assert late.transport == "tcp" and "cannot reach" in late.fallback_reason
        assert "shared memory unusable: cannot reach" in caplog.text
        assert late.current.transport == "tcp" and late.rejected == 0
        late.close()
    finally:
        first.close()
        publisher.close()


def test_a_learner_that_offers_no_shared_memory_is_answered_over_zeromq(context, caplog):
    publisher, subscriber = pair(context, learner="tcp")
    try:
        with caplog.at_level(logging.WARNING, logger="asyncfp8.sync"):
            publisher.publish(0, model(0, 0).items())
            wait_for(subscriber, 0)
        assert publisher.shm is None and subscriber.transport == "tcp"
        assert "does not offer shared memory" in caplog.text
    finally:
        subscriber.close()
        publisher.close()


def memfd_holders(stream: str) -> set[int]:
    """Processes that still hold a segment of the publisher `stream`."""
    holders = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            maps = (proc / "maps").read_text()
        except OSError:
            continue
        if f"asyncfp8-{stream}-" in maps:
            holders.add(int(proc.name))
    return holders


LEARNER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_sync_shm import model
    from asyncfp8.sync import VersionPublisher
    version_port, snapshot_port, first = map(int, sys.argv[1:4])
    publisher = VersionPublisher(
        f"tcp://127.0.0.1:{{version_port}}", f"tcp://127.0.0.1:{{snapshot_port}}", chunk_bytes=2000
    )
    print("stream", publisher.stream, flush=True)
    number = first
    while True:
        print("publishing", number, flush=True)
        publisher.publish(number, model(first, number - first).items())
        number += 1
        time.sleep(0.05)
    """
)


def start_learner(tmp_path, ports, first, failpoint=None):
    script = tmp_path / "learner.py"
    script.write_text(LEARNER.format(tests=str(Path(__file__).parent)))
    log = (tmp_path / f"learner-{first}.log").open("w")
    env = os.environ | ({FAILPOINTS_ENV: failpoint} if failpoint else {})
    process = subprocess.Popen(
        [sys.executable, str(script), *map(str, ports), str(first)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    return process, tmp_path / f"learner-{first}.log"


def read_log(path: Path, what: str, timeout=60.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines()
        found = [line.split()[1] for line in lines if line.startswith(what)]
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {what!r} in {path.read_text()}")


def expected_bits(first, number):
    return {k: bits(v) for k, v in model(first, number - first).items()}


@pytest.mark.slow
def test_learner_and_worker_killed_mid_publish_leave_no_half_version_and_no_segment(
    tmp_path, context, caplog
):
    shm_before = set(os.listdir("/dev/shm"))
    ports = free_ports(2)
    address = [f"tcp://127.0.0.1:{port}" for port in ports]
    # The learner dies by SIGKILL between two notices of a version (about 6 per version).
    first_learner, first_log = start_learner(
        tmp_path, ports, 0, failpoint="publish.between_chunks=15"
    )
    subscriber = VersionSubscriber(*address, context=context, transport="shm")
    applied, streams = [], []
    try:
        with caplog.at_level(logging.INFO, logger="asyncfp8.sync"):
            deadline = time.monotonic() + 60
            while first_learner.poll() is None and time.monotonic() < deadline:
                version = subscriber.poll(timeout_ms=20)
                if version is not None:
                    applied.append(version.number)
                    assert {k: bits(v) for k, v in version.weights.items()} == expected_bits(
                        0, version.number
                    )
            assert first_learner.returncode == -signal.SIGKILL
            half_sent = int(read_log(first_log, "publishing")[-1])
            streams.append(read_log(first_log, "stream")[0])
            subscriber.poll(timeout_ms=200)
            assert subscriber.version < half_sent  # never the half-written version
            # A new learner on the same ports (a resumed one numbers past the old one).
            second_learner, second_log = start_learner(tmp_path, ports, 100)
            streams.append(read_log(second_log, "stream")[0])
            got = wait_for(subscriber, 103, timeout=60, at_least=True)
            applied += got
        assert applied == sorted(set(applied)) and half_sent not in applied
        assert {k: bits(v) for k, v in subscriber.tensors.items()} == expected_bits(
            100, subscriber.version
        )
        assert f"dropped incomplete version {half_sent} " in caplog.text
        # The dead learner's segments: nobody holds them any more, so the kernel freed them.
        assert memfd_holders(streams[0]) == set()
        # Now a worker killed while it copies: the learner goes on, and only it and the
        # live subscriber of this test hold its segments.
        worker = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from asyncfp8.sync import VersionSubscriber\n"
                "s = VersionSubscriber(sys.argv[1], sys.argv[2], transport='shm')\n"
                "while True: s.poll(timeout_ms=5)",
                *address,
            ]
        )
        deadline = time.monotonic() + 60
        while worker.pid not in memfd_holders(streams[1]) and time.monotonic() < deadline:
            subscriber.poll(timeout_ms=20)
        assert worker.pid in memfd_holders(streams[1])
        worker.kill()
        worker.wait()
        latest = int(read_log(second_log, "publishing")[-1])
        wait_for(subscriber, latest + 2, timeout=60, at_least=True)
        assert second_learner.poll() is None
        assert memfd_holders(streams[1]) == {second_learner.pid, os.getpid()}
        second_learner.kill()
        second_learner.wait()
        subscriber.close()
        assert memfd_holders(streams[1]) == set()
        assert set(os.listdir("/dev/shm")) == shm_before  # memfd segments never had a name
    finally:
        subscriber.close()
        for process in (first_learner, locals().get("second_learner")):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


def test_background_publish_sends_exactly_the_weights_given_to_submit(context):
    publisher, subscriber = pair(context, worker="tcp")
    background = BackgroundPublisher(publisher)
    weights = {k: v.float() for k, v in model(0, 0).items()}
    try:
        for number in range(4):
            waited = background.submit(
                number, weights.items(), lambda named: iter(named), extra={"s": torch.ones(())}
            )
            assert waited >= 0
            sent = {k: bits(v.clone()) for k, v in weights.items()}  # the master dtype, FP32
            for tensor in weights.values():  # the next step trains at once, in place
                tensor.add_(1.0)
            background.wait()
            wait_for(subscriber, number)
            assert {k: bits(v) for k, v in subscriber.current.weights.items()} == sent
            assert set(subscriber.current.extra) == {"s"}
        assert background.last.version == 3
    finally:
        subscriber.close()
        publisher.close()


class KeptVersions:
    """A publisher that keeps what each version's weights held when it read them."""

    def __init__(self):
        self.in_flight = threading.Event()
        self.kept: dict[int, dict[str, torch.Tensor]] = {}

    def publish(self, version, weights, extra, **_):
        self.kept[version] = {name: tensor.clone() for name, tensor in weights}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_weights_are_copied_whole_before_the_publish_thread_reads_them():
    """A GPU tensor reaches its pinned buffer by an asynchronous copy, so the snapshot
    waits for its GPU before the publish thread reads the buffer (a check of the CPU
    buffers themselves never waited). Kernels queued ahead of the copy make it late."""
    versions = KeptVersions()
    background = BackgroundPublisher(versions)
    busy = torch.randn(8192, 8192, device="cuda")
    for number in range(3):
        weights = {"w": torch.full((8192, 8192), float(number + 1), device="cuda")}
        for _ in range(20):  # ~20 ms each, queued before the copy
            busy = (busy @ busy).tanh_()
        background.submit(number, weights.items(), lambda named: iter(named))
        background.wait()
        assert bool(versions.kept[number]["w"].eq(number + 1).all()), f"version {number}"


def test_a_failed_background_publish_is_raised_on_the_callers_thread(context):
    publisher, subscriber = pair(context, worker="tcp")
    background = BackgroundPublisher(publisher)
    try:
        background.submit(5, model(0, 0).items(), lambda named: iter(named))
        background.submit(3, model(0, 0).items(), lambda named: iter(named))  # goes back
        with pytest.raises(PublishFailed, match="publishing version 3 failed") as raised:
            background.wait()
        assert "versions must increase" in str(raised.value.__cause__)
        background.submit(6, model(0, 1).items(), lambda named: iter(named))
        background.wait()
        wait_for(subscriber, 6)
    finally:
        subscriber.close()
        publisher.close()


def test_fuzzed_notices_through_a_real_socket_are_all_rejected_then_a_good_one_applies(context):
    import random

    from asyncfp8.sync.shm import SHM_TOPIC, SegmentWriter

    from .test_sync import mutations

    rng = random.Random(7)
    writer = SegmentWriter("fuzz", chunk_bytes=1 << 20)
    writer.begin(0)
    for name, tensor in model(0, 0).items():
        writer.put(WEIGHT, name, tensor)
    good = [writer.commit("bf16", {}), b""]
    rogue = context.socket(zmq.PUB)
    rogue.bind(LOOPBACK)
    snapshots = context.socket(zmq.ROUTER)
    snapshots.bind(LOOPBACK)
    subscriber = VersionSubscriber(
        rogue.getsockopt_string(zmq.LAST_ENDPOINT),
        snapshots.getsockopt_string(zmq.LAST_ENDPOINT),
        context=context,
        transport="shm",
    )
    time.sleep(0.3)
    try:
        delivered = 0
        for _ in range(200):
            bad = mutations(good, rng)
            delivered += bad[0][:1] == SHM_TOPIC  # what the subscription lets through
            rogue.send_multipart(bad)
        rogue.send_multipart(good)
        version, deadline = None, time.monotonic() + 20
        while version is None and time.monotonic() < deadline:
            version = subscriber.poll(timeout_ms=20)
        assert version is not None and version.transport == "shm"
        assert {k: bits(v) for k, v in version.weights.items()} == {
            k: bits(v) for k, v in model(0, 0).items()
        }
        assert delivered > 150 and subscriber.rejected == delivered
        assert subscriber.transport == "shm"  # bad notices are rejected, not a reason to fall back
    finally:
        subscriber.close()
        rogue.close(linger=0)
        snapshots.close(linger=0)
        writer.close()


def test_a_large_tensor_goes_in_aligned_pieces_and_a_spoiled_piece_is_refused():
    """A tensor larger than a group is announced piece by piece (the worker copies the
    first pieces while the learner writes the next); every piece starts 64-byte aligned
    and has its own checksum, so a corrupted byte in a later piece is caught too."""
    from asyncfp8.sync.limits import Limits
    from asyncfp8.sync.shm import SegmentWriter
    from asyncfp8.sync.shm_reader import SegmentReader, ShmAssembler, ShmCorrupt, parse_notice

    g = torch.Generator().manual_seed(3)
    weights = {
        "big": torch.randn(100, 333, generator=g).to(torch.bfloat16),  # 66,600 bytes
        "odd": torch.randn(7, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 5, dtype=torch.bfloat16),
    }
    writer = SegmentWriter("pieces", chunk_bytes=10_000)
    reader = SegmentReader()
    try:
        frames = []
        for version in range(3):  # version 0 makes the segments, 1 and 2 are written live
            writer.begin(version)
            frames = [f for name, t in weights.items() for f in writer.put(WEIGHT, name, t)]
            frames.append(writer.commit("bf16", {}))
        notices = [parse_notice(frame, Limits()) for frame in frames]
        pieces = [p for notice in notices for p in notice["tensors"] if p["name"] == "big"]
        assert len(notices) > 6 and len(pieces) > 6
        assert all(p["at"] % 64 == 0 for p in pieces)
        assert sum(p["length"] for p in pieces) == 66_600
        first = notices[0]
        reader.attach(first["address"], first["generation"], first["segment_bytes"])
        assembler = ShmAssembler(reader)
        version = None
        for notice, frame in zip(notices, frames, strict=True):
            version = assembler.feed(notice, len(frame))
        assert version is not None and version.number == 2
        assert {k: bits(v) for k, v in version.weights.items()} == {
            k: bits(v) for k, v in weights.items()
        }
        # A byte of the fourth piece spoiled in the segment: that piece fails its checksum.
        segment = writer.maps[writer.latest]
        spoiled = pieces[3]["offset"] + pieces[3]["at"] + 5
        segment[spoiled] ^= 0x10
        assembler = ShmAssembler(reader)
        with pytest.raises(ShmCorrupt, match="big: checksum mismatch"):
            for notice, frame in zip(notices, frames, strict=True):
                assembler.feed(notice, len(frame))
        segment[spoiled] ^= 0x10
    finally:
        reader.release()
        writer.close()


def test_an_address_of_this_hosts_own_interface_is_local_whatever_its_name_resolves_to():
    """`transport=auto` takes shared memory for a learner on this host. A learner named by
    its LAN address (as a Ray node's is) is on this host too, though this machine's name
    resolves to 127.0.0.1: it was taken for remote, and its workers were sent versions
    over TCP. The address is the one the kernel would send from (Ray picks a node's IP so)."""
    from asyncfp8.sync.transport import is_local

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.9", 9))  # TEST-NET-3: a route is looked up, nothing sent
        except OSError:
            pytest.skip("no route off this host: it has no interface but loopback")
        own = probe.getsockname()[0]
    assert is_local(f"tcp://{own}:5555")
    assert is_local("tcp://127.0.0.1:5555") and is_local("tcp://localhost:5555")
    assert not is_local("tcp://203.0.113.9:5555")  # not this host's
    assert not is_local("tcp://no-such-host.invalid:5555")
