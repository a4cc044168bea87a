import logging
import random
import time

import msgpack
import pytest
import torch
import zmq

from asyncfp8.precision import get_policy
from asyncfp8.sync import (
    Curve,
    HandshakeWatch,
    Limits,
    RejectedMessage,
    Trajectory,
    TrajectoryReceiver,
    TrajectorySender,
    VersionAssembler,
    VersionPublisher,
    VersionSubscriber,
    decode_version,
    encode_version,
)
from asyncfp8.sync.codec import DIGEST_BYTES, VERSION_TOPIC, seal
from asyncfp8.sync.keys import make_keys
from asyncfp8.sync.limits import RejectionLog

LOOPBACK = "tcp://127.0.0.1:*"
HEADER_AT = 1 + DIGEST_BYTES  # a chunk header: topic byte, digest, then msgpack


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def toy_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 48, generator=g) * 0.02,
        "model.layers.0.self_attn.q_proj.weight": torch.randn(48, 48, generator=g) * 0.02,
        "model.layers.0.mlp.up_proj.weight": torch.randn(160, 48, generator=g) * 0.02,
        "model.layers.0.input_layernorm.weight": torch.ones(48),
        "lm_head.weight": torch.randn(64, 48, generator=g) * 0.02,
    }


def sparse_step(master, rng, fraction=0.01):
    """An RL-sized update: a few percent of the weights move (some by a lot)."""
    for tensor in master.values():
        flat = tensor.view(-1)
        index = torch.randperm(flat.numel(), generator=rng)[: max(1, int(fraction * flat.numel()))]
        flat[index] += torch.randn(index.numel(), generator=rng) * 0.01


def engine_tensors(policy, master):
    return dict(policy.quantize_weights((n, t.to(torch.bfloat16)) for n, t in master.items()))


def wait_for(subscriber, number, timeout=20.0):
    deadline = time.monotonic() + timeout
    got = []
    while time.monotonic() < deadline:
        version = subscriber.poll(timeout_ms=50)
        if version is not None:
            got.append(version)
        if subscriber.version == number:
            return got
    raise AssertionError(f"subscriber stuck at version {subscriber.version}, waiting for {number}")


# --- codec ----------------------------------------------------------------------------------------


def test_patch_is_lossless_bit_for_bit_including_signed_zeros_and_nan():
    base = torch.tensor([0.0, 1.0, float("nan"), -2.0, 5.0] * 50, dtype=torch.bfloat16)
    new = base.clone()
    new[0] = -0.0  # equal as floats, different bits
    new[7] = float("inf")
    messages = encode_version(1, [("w", new)], base={"w": base}, base_version=0)
    header = msgpack.unpackb(messages[0][0][HEADER_AT:])
    assert header["tensors"][0]["encoding"] == "delta"
    got = decode_version(messages, base={"w": base}, base_version=0).weights["w"]
    assert bits_equal(got, new)


def test_a_dense_change_goes_full_and_chunks_respect_the_size():
    base = {f"w{i}": torch.randn(64, 64) for i in range(3)}  # 16 KiB each
    base |= {"big": torch.randn(25_000), "small": torch.randn(250)}  # 100,000 and 1,000 bytes
    new = {k: v + 1 for k, v in base.items()}
    messages = encode_version(2, new.items(), base=base, base_version=1, chunk_bytes=40_000)
    # A tensor that does not fit in the room left starts a chunk; one that spans chunks
    # has them to itself (each part is received in place), and what follows starts anew.
    assert [len(m[1]) for m in messages] == [32_768, 16_384, 40_000, 40_000, 20_000, 1_000]
    assert all(
        e["encoding"] == "full"
        for m in messages
        for e in msgpack.unpackb(m[0][HEADER_AT:])["tensors"]
    )
    version = decode_version(messages, base=base, base_version=1)
    assert all(bits_equal(version.weights[k], new[k]) for k in new)


def test_a_full_tensor_is_checked_part_by_part_and_a_spoiled_part_is_refused():
    """A full tensor carries no checksum of its own (format 3): each part of it has one,
    copied and hashed in one pass by the sender, and the parts must arrive in order."""
    tensor = torch.randn(64, 333).to(torch.bfloat16)  # 42,624 bytes: parts in 3 chunks
    messages = encode_version(0, [("w", tensor)], chunk_bytes=16_000)
    assert len(messages) == 3
    headers = [msgpack.unpackb(m[0][HEADER_AT:]) for m in messages]
    assert all(e["result_checksum"] is None for h in headers for e in h["tensors"])
    assert bits_equal(decode_version(messages).weights["w"], tensor)
    spoiled = [list(m) for m in messages]
    payload = bytearray(spoiled[1][1])
    payload[1234] ^= 0x01
    spoiled[1][1] = bytes(payload)
    with pytest.raises(RejectedMessage, match="w: payload checksum mismatch"):
        decode_version(spoiled)
    with pytest.raises(RejectedMessage, match="chunk 2 arrived, 1 expected"):
        decode_version([messages[0], messages[2]])
    # A header claiming a whole-tensor checksum for a full tensor does not parse.
    header = headers[0]
    header["tensors"][0]["result_checksum"] = 5
    forged = VERSION_TOPIC + seal(msgpack.packb(header))
    with pytest.raises(RejectedMessage, match="unexpected result checksum"):
        decode_version([[forged, messages[0][1]]])


def test_a_patch_against_the_wrong_base_is_refused():
    base = {"w": torch.zeros(1000)}
    new = {"w": torch.zeros(1000)}
    new["w"][3] = 1
    messages = encode_version(5, new.items(), base=base, base_version=4)
    with pytest.raises(RejectedMessage, match="delta against version 4, but this receiver has 3"):
        decode_version(messages, base=base, base_version=3)


# --- publisher / subscriber -----------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("precision", ["bf16", "fp8", "int8", "fp8+fp8_kv"])
def test_fifty_versions_bit_for_bit_and_a_late_joiner_catches_up(precision, transport):
    policy = get_policy(precision)
    context = zmq.Context()
    publisher = VersionPublisher(LOOPBACK, LOOPBACK, chunk_bytes=8_000, context=context)
    early = VersionSubscriber(
        publisher.publish_address, publisher.snapshot_address, context=context, transport=transport
    )
    late = None
    time.sleep(0.3)  # let the SUB connect before the first publish (PUB drops until then)
    master, rng = toy_model(), torch.Generator().manual_seed(1)
    full_size = delta_size = 0
    try:
        for number in range(50):
            if number:
                sparse_step(master, rng)
            expected = engine_tensors(policy, master)
            extra = {"model.layers.0.self_attn.k_scale": torch.rand((), generator=rng)}
            stats = publisher.publish(
                number,
                expected.items(),
                extra,
                policy=policy.name,
                engine_config=policy.engine_config(),
            )
            assert stats.media == (transport,)
            if number == 0:
                full_size = stats.wire_bytes
            else:
                delta_size = max(delta_size, stats.wire_bytes)
            if number == 37:
                late = VersionSubscriber(
                    publisher.publish_address,
                    publisher.snapshot_address,
                    context=context,
                    transport=transport,
                )
            for subscriber in filter(None, (early, late)):
                received = wait_for(subscriber, number)
                assert subscriber.rejected == 0 and subscriber.transport == transport
                version = subscriber.current
                assert version.transport == transport
                assert set(version.weights) == set(expected) and set(version.extra) == set(extra)
                for name, tensor in (expected | extra).items():
                    assert bits_equal(subscriber.tensors[name], tensor), (number, name)
                if subscriber is early:
                    assert [v.number for v in received] == [number]  # every version, in order
                    assert version.policy == policy.name
                    assert version.engine_config == policy.engine_config()
        assert late.snapshot_requests >= 1 and publisher.snapshots_served >= 1
        if transport == "tcp":
            # Toy tensors are one or two FP8 blocks: a moved block maximum rescales a whole
            # tensor. bench/sync.py measures deltas at a real model's size.
            assert delta_size * (3 if policy.name == "bf16" else 1) < full_size
    finally:
        for endpoint in filter(None, (early, late, publisher)):
            endpoint.close()
        context.term()


def test_a_subscriber_that_missed_the_first_version_on_pub_still_gets_it():
    """The worker asked for a snapshot before anything was published ("none"), then the
    first version went out on PUB before its SUB had joined: it must ask again."""
    context = zmq.Context()
    publisher = VersionPublisher(LOOPBACK, LOOPBACK, context=context)
    silent_pub = context.socket(zmq.PUB)  # stands in for a PUB the worker joined too late
    silent_pub.bind(LOOPBACK)
    subscriber = VersionSubscriber(
        silent_pub.getsockopt_string(zmq.LAST_ENDPOINT), publisher.snapshot_address, context=context
    )
    try:
        time.sleep(0.3)
        assert subscriber.poll(timeout_ms=200) is None  # the "none" reply
        publisher.publish(0, toy_model().items())
        wait_for(subscriber, 0, timeout=10)
    finally:
        subscriber.close()
        silent_pub.close()
        publisher.close()
        context.term()


def test_chunks_queued_for_a_stalled_subscriber_never_change_under_it():
    """Full tensors go out zero-copy from the publisher's state. A subscriber that stops
    reading keeps them queued; the next version must not be written into them: the
    publisher copies its state instead, and every chunk of the old version still arrives
    as it was sent."""
    context = zmq.Context()
    publisher = VersionPublisher(LOOPBACK, LOOPBACK, chunk_bytes=64 << 10, context=context)
    stalled = context.socket(zmq.SUB)
    stalled.rcvhwm, stalled.rcvbuf = 1, 64 << 10
    stalled.setsockopt(zmq.SUBSCRIBE, VERSION_TOPIC)
    stalled.connect(publisher.publish_address)
    time.sleep(0.3)
    g = torch.Generator().manual_seed(3)
    versions = [
        {f"w{i}": torch.randn(1 << 20, generator=g).to(torch.bfloat16) for i in range(24)}
        for _ in range(3)
    ]  # 48 MiB each: more than loopback buffers hold
    versions[2] = {k: v.clone() for k, v in versions[1].items()}
    versions[2]["w0"][:1000] += 1  # a delta: written into the base in place
    try:
        publisher.publish(0, versions[0].items())
        queued = publisher.state["w23"].data_ptr()
        assert any(not tracker.done for tracker in publisher._sending)
        publisher.publish(1, versions[1].items())
        assert publisher.state["w23"].data_ptr() != queued  # copied, not written over
        publisher.publish(2, versions[2].items())
        assert all(bits_equal(publisher.state[k], v) for k, v in versions[2].items())
        received: dict[int, list] = {0: [], 1: [], 2: []}
        while len(received[2]) == 0 or not msgpack.unpackb(received[2][-1][0][HEADER_AT:])["final"]:
            frames = stalled.recv_multipart()
            received[msgpack.unpackb(frames[0][HEADER_AT:])["version"]].append(frames)
        previous = None
        for number, messages in received.items():
            got = decode_version(messages, base=previous, base_version=number - 1)
            assert all(bits_equal(got.weights[k], v) for k, v in versions[number].items())
            previous = got.weights
    finally:
        stalled.close()
        publisher.close()
        context.term()


def test_versions_must_increase():
    context = zmq.Context()
    publisher = VersionPublisher(LOOPBACK, LOOPBACK, context=context)
    try:
        publisher.publish(3, [("w", torch.zeros(4))])
        with pytest.raises(ValueError, match="versions must increase: 3 after 3"):
            publisher.publish(3, [("w", torch.zeros(4))])
    finally:
        publisher.close()
        context.term()


# --- trajectories ---------------------------------------------------------------------------------


def trajectory(i, n=5):
    return Trajectory(
        prompt_ids=[1, 2, 3],
        token_ids=list(range(n)),
        logprobs=[-0.5] * n,
        versions=[i // 10] * n,
        reward=float(i % 2),
        group_id=f"g{i // 4}",
        prompt_index=i // 4,
        seq=i,
        meta={"i": i},
    )


def test_trajectories_exactly_once_across_a_reconnect():
    context = zmq.Context()
    receiver = TrajectoryReceiver(LOOPBACK, context=context)
    address = receiver.address
    sender = TrajectorySender(address, "worker-0", context=context, resend_after=0.2)
    got = []
    try:
        for i in range(30):
            sender.send(trajectory(i))
        deadline = time.monotonic() + 5
        while len(got) < 10 and time.monotonic() < deadline:
            got += receiver.poll(timeout_ms=50)
        # The learner's socket goes away (its acks with it) and comes back on the same
        # address, keeping its dedup state, as after a restart from a checkpoint.
        state = receiver.state_dict()
        receiver.close()
        for i in range(30, 60):
            sender.send(trajectory(i))
        sender.pump()
        time.sleep(0.3)
        receiver = TrajectoryReceiver(address, context=context)
        receiver.load_state_dict(state)
        deadline = time.monotonic() + 20
        while sender.outbox and time.monotonic() < deadline:
            got += receiver.poll(timeout_ms=50)
            sender.pump(timeout_ms=10)
        got += receiver.poll(timeout_ms=200)
        assert not sender.outbox
        assert sorted(t.meta["i"] for t in got) == list(range(60))  # none lost, none twice
        assert all(t.worker_id == "worker-0" for t in got)
        assert got[0].logprobs == [-0.5] * 5 and got[0].versions == [0] * 5
    finally:
        sender.close()
        receiver.close()
        context.term()


def test_trajectory_fields_are_validated():
    limits = Limits()
    payload = trajectory(1).encode("w/1")
    sender, decoded = Trajectory.decode(payload, limits)
    assert sender == "w/1" and decoded.meta == {"i": 1}
    with pytest.raises(ValueError, match="one entry per token"):
        Trajectory([1], [1, 2], [-1.0], [0, 0], 1.0, "g").encode("w")
    bad = msgpack.unpackb(payload[8:])
    bad["logprobs"] = b"\x00\x00\xc0\x7f" * 5  # NaN
    with pytest.raises(RejectedMessage, match="NaN"):
        Trajectory.decode(seal(msgpack.packb(bad)), limits)
    with pytest.raises(RejectedMessage, match="exceeds"):
        Trajectory.decode(payload, Limits(max_message_bytes=10))


# --- fuzzing: truncated, bit-flipped and random frames --------------------------------------------


def mutations(frames, rng):
    kind = rng.choice(["truncate", "flip", "random", "drop", "extra"])
    if kind == "drop" and len(frames) == 1:
        kind = "extra"  # a message needs at least one frame
    frames = [bytearray(f) for f in frames]
    target = rng.randrange(len(frames))
    if kind == "truncate" and frames[target]:
        frames[target] = frames[target][: rng.randrange(len(frames[target]))]
    elif kind == "flip" and frames[target]:
        position = rng.randrange(len(frames[target]))
        frames[target][position] ^= 1 << rng.randrange(8)
    elif kind == "random":
        frames[target] = bytearray(rng.randbytes(rng.randrange(1, 300)))
    elif kind == "drop":
        frames.pop(target)
    else:
        frames.append(bytearray(b"junk"))
    return [bytes(f) for f in frames]


def test_fuzzed_version_messages_are_all_rejected_and_good_ones_still_pass():
    rng = random.Random(0)
    base = toy_model()
    new = {k: v.clone() for k, v in base.items()}
    sparse_step(new, torch.Generator().manual_seed(2))
    good = encode_version(1, new.items(), base=base, base_version=0)
    assert len(good) == 1
    for _ in range(300):
        bad = mutations(good[0], rng)
        with pytest.raises(RejectedMessage):
            VersionAssembler(base, 0).feed(bad)
    version = VersionAssembler(base, 0).feed(good[0])
    assert all(bits_equal(version.weights[k], new[k]) for k in new)


def subscriber_of_a_rogue_publisher(context):
    """A PUB socket anyone can send anything through, a ROUTER standing in for the
    snapshot service, and a TCP VersionSubscriber connected to both."""
    rogue_pub = context.socket(zmq.PUB)
    rogue_pub.bind(LOOPBACK)
    snapshot_router = context.socket(zmq.ROUTER)
    snapshot_router.bind(LOOPBACK)
    subscriber = VersionSubscriber(
        rogue_pub.getsockopt_string(zmq.LAST_ENDPOINT),
        snapshot_router.getsockopt_string(zmq.LAST_ENDPOINT),
        context=context,
        transport="tcp",
    )
    return rogue_pub, snapshot_router, subscriber


def test_fuzzed_frames_through_real_sockets_never_stop_either_receiver():
    rng = random.Random(1)
    context = zmq.Context()
    rogue_pub, snapshot_router, subscriber = subscriber_of_a_rogue_publisher(context)
    receiver = TrajectoryReceiver(LOOPBACK, context=context)
    rogue_dealer = context.socket(zmq.DEALER)
    rogue_dealer.connect(receiver.address)
    time.sleep(0.3)
    try:
        good_version = encode_version(0, toy_model().items())[0]
        good_trajectory = trajectory(0).encode("w/fuzz")
        bad_count, delivered = 200, 0
        for _ in range(bad_count):
            bad = mutations(good_version, rng)
            # The SUB socket takes only messages that start with its topic byte.
            delivered += bad[0][:1] == VERSION_TOPIC
            rogue_pub.send_multipart(bad)
            rogue_dealer.send_multipart(mutations([good_trajectory], rng))
        rogue_pub.send_multipart(good_version)
        rogue_dealer.send(good_trajectory)
        accepted, version = [], None
        deadline = time.monotonic() + 20
        while (version is None or not accepted) and time.monotonic() < deadline:
            version = subscriber.poll(timeout_ms=20) or version
            accepted += receiver.poll(timeout_ms=20)
        assert version is not None and version.number == 0
        assert len(accepted) == 1 and accepted[0].meta == {"i": 0}
        assert receiver.rejected == bad_count
        assert delivered > 150 and subscriber.rejected == delivered
    finally:
        for socket in (rogue_pub, snapshot_router, rogue_dealer):
            socket.close(linger=0)
        subscriber.close()
        receiver.close()
        context.term()


def test_a_spoiled_chunk_received_in_place_is_refused():
    """A chunk that is one slice of one tensor is copied out of ZeroMQ's message into
    the tensor and hashed in the same pass: a flipped bit, a short or a long payload is
    still refused, and the next good version arrives whole."""
    context = zmq.Context()
    rogue_pub, snapshot_router, subscriber = subscriber_of_a_rogue_publisher(context)
    time.sleep(0.3)
    weights = {"w": torch.randn(4000), "v": torch.randn(3000)}  # parts of 4,000 bytes
    try:
        for number, spoil in enumerate(["flip", "short", "long"], start=1):
            messages = encode_version(number, weights.items(), chunk_bytes=4000)
            frames = [bytearray(f) for f in messages[2]]
            if spoil == "flip":
                frames[1][1234] ^= 0x10
            elif spoil == "short":
                frames[1] = frames[1][:-8]
            else:
                frames[1] += b"12345678"
            messages[2] = [bytes(f) for f in frames]
            for message in messages:
                rogue_pub.send_multipart(message)
        good = encode_version(4, weights.items(), chunk_bytes=4000)
        assert all(len(m[1]) == 4000 for m in good[:-1])
        for message in good:
            rogue_pub.send_multipart(message)
        got = wait_for(subscriber, 4)
        assert [v.number for v in got] == [4] and subscriber.rejected == 3
        assert all(bits_equal(got[0].weights[k], weights[k]) for k in weights)
    finally:
        for socket in (rogue_pub, snapshot_router):
            socket.close(linger=0)
        subscriber.close()
        context.term()


def test_oversized_and_wrongly_versioned_messages_are_rejected():
    limits = Limits(max_message_bytes=2_000, max_tensors=2)
    messages = encode_version(0, toy_model().items())
    with pytest.raises(RejectedMessage, match="exceeds max_message_bytes"):
        VersionAssembler(limits=limits).feed(messages[0])
    header = msgpack.unpackb(messages[0][0][HEADER_AT:])
    header["format"] = 99
    with pytest.raises(RejectedMessage, match="unknown format 99"):
        VersionAssembler().feed([VERSION_TOPIC + seal(msgpack.packb(header)), messages[0][1]])
    with pytest.raises(RejectedMessage, match="5 tensors exceed 2"):
        VersionAssembler(limits=Limits(max_tensors=2)).feed(messages[0])


def test_rejection_log_counts_every_rejection_and_caps_the_lines(caplog):
    rejections = RejectionLog(logging.getLogger("test.rejections"), burst=3, window=0.2)
    with caplog.at_level(logging.WARNING, logger="test.rejections"):
        for i in range(50):
            rejections("trajectory message", f"bad {i}")
        rejections("lease request", "bad lease")
        time.sleep(0.25)
        rejections.tick()
    assert rejections.counts == {"trajectory message": 50, "lease request": 1}
    assert rejections.total == 51
    lines = [r.getMessage() for r in caplog.records]
    one_by_one = [line for line in lines if line.startswith("rejected a trajectory message")]
    assert one_by_one == [f"rejected a trajectory message: bad {i}" for i in range(3)]
    (summary,) = [line for line in lines if line.startswith("rejected 47 more: trajectory message")]
    assert "the last: bad 49" in summary
    assert "rejected a lease request: bad lease" in lines


def test_chunks_of_two_streams_never_make_one_version():
    # A learner died after chunk 0 of version 5; the one that resumed it sends a version
    # 5 of its own (it should not: it reserves numbers, but the receiver must not rely
    # on that). Chunk 1 of the new stream must not complete the old stream's chunk 0.
    old = encode_version(5, toy_model(0).items(), chunk_bytes=4096, stream="dead")
    new = encode_version(5, toy_model(1).items(), chunk_bytes=4096, stream="resumed")
    assert len(old) == len(new) > 2
    assembler = VersionAssembler()
    assembler.feed(old[0])
    with pytest.raises(RejectedMessage, match="stream"):
        assembler.feed(new[1])


# --- CURVE ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_curve_keeps_out_clients_without_the_keys(tmp_path, caplog):
    keys = make_keys(tmp_path / "keys")
    intruder_keys = make_keys(tmp_path / "intruder")
    curve, intruder = Curve(True, str(keys)), Curve(True, str(intruder_keys))
    context = zmq.Context()
    learner_watch, worker_watch = HandshakeWatch(), HandshakeWatch()
    receiver = TrajectoryReceiver(LOOPBACK, curve=curve, context=context, watch=learner_watch)
    publisher = VersionPublisher(LOOPBACK, LOOPBACK, curve=curve, context=context)
    plain_sender = TrajectorySender(receiver.address, "plain", context=context)
    foreign_sender = TrajectorySender(receiver.address, "foreign", curve=intruder, context=context)
    good_sender = TrajectorySender(receiver.address, "good", curve=curve, context=context)
    # A client that knows the server's public key but whose own key is not allowed.
    stranger_keys = tmp_path / "stranger"
    stranger_keys.mkdir()
    for name, source in (("server.key", keys), ("client.key_secret", intruder_keys)):
        (stranger_keys / name).write_bytes((source / name).read_bytes())
    stranger = TrajectorySender(
        receiver.address, "stranger", curve=Curve(True, str(stranger_keys)), context=context
    )
    # A rogue publisher on its own port, without the learner's secret key: a worker
    # pointed at it must not take its weights.
    rogue = VersionPublisher(LOOPBACK, LOOPBACK, curve=intruder, context=context)
    fooled = VersionSubscriber(
        rogue.publish_address,
        rogue.snapshot_address,
        curve=curve,
        context=context,
        watch=worker_watch,
    )
    worker = VersionSubscriber(
        publisher.publish_address, publisher.snapshot_address, curve=curve, context=context
    )
    try:
        time.sleep(0.5)
        for sender in (plain_sender, foreign_sender, stranger, good_sender):
            sender.send(trajectory(7))
        rogue.publish(0, [("w", torch.ones(8))])
        publisher.publish(0, [("w", torch.zeros(8))])
        got, deadline = [], time.monotonic() + 5
        while time.monotonic() < deadline:
            got += receiver.poll(timeout_ms=50)
            worker.poll(timeout_ms=10)
            fooled.poll(timeout_ms=10)
        assert [t.worker_id for t in got] == ["good"]
        assert worker.version == 0 and torch.equal(worker.tensors["w"], torch.zeros(8))
        assert fooled.version is None
        # Each refusal is logged: the foreign client key by the ZAP check, the plain
        # client and the rogue publisher (wrong server key) as failed handshakes.
        refusals = [r.getMessage() for r in caplog.records if "refused a CURVE" in r.getMessage()]
        assert refusals and all(str(keys / "clients") in line for line in refusals)
        assert learner_watch.failures >= 2 and worker_watch.failures >= 1
    finally:
        learner_watch.close()
        worker_watch.close()
        for endpoint in (
            plain_sender,
            foreign_sender,
            stranger,
            good_sender,
            receiver,
            publisher,
            rogue,
            fooled,
            worker,
        ):
            endpoint.close()
        from asyncfp8.sync.security import stop_authenticators

        stop_authenticators()
        context.term()


def test_keys_cli_refuses_to_overwrite(tmp_path):
    from asyncfp8.sync.keys import main

    main(["--out", str(tmp_path / "k")])
    assert (tmp_path / "k" / "clients" / "client.key").is_file()
    assert oct((tmp_path / "k" / "server.key_secret").stat().st_mode)[-3:] == "600"
    with pytest.raises(FileExistsError, match="already holds keys"):
        main(["--out", str(tmp_path / "k")])


def test_any_real_dtype_travels_so_a_new_format_needs_no_wire_table():
    """The wire names dtypes as torch does: a format storing e8m0 scales or packed FP4
    (none built in) sends them as they are, and its deltas work on their bytes."""
    rng = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 255, (4, 96), generator=rng, dtype=torch.uint8)
    new = {
        "w": raw.view(torch.float4_e2m1fn_x2),
        "w_scale": raw[:, :3].contiguous().view(torch.float8_e8m0fnu),
        "ids": raw[:, :4].contiguous().view(torch.uint16),
    }
    version = decode_version(encode_version(1, new.items()))
    assert all(
        version.weights[k].dtype == t.dtype and bits_equal(version.weights[k], t)
        for k, t in new.items()
    )
    changed = {k: t.clone() for k, t in new.items()}
    changed["w"].view(torch.uint8)[0, 0] ^= 1
    messages = encode_version(2, changed.items(), base=new, base_version=1)
    assert msgpack.unpackb(messages[0][0][HEADER_AT:])["tensors"][0]["encoding"] == "delta"
    got = decode_version(messages, base=new, base_version=1).weights["w"]
    assert bits_equal(got, changed["w"])


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int4])
def test_a_dtype_that_cannot_travel_is_refused_when_sent(dtype):
    with pytest.raises(ValueError, match="cannot be sent"):
        encode_version(0, [("w", torch.empty(0, dtype=dtype))])


@pytest.mark.parametrize(
    "name", ["int4", "qint8", "complex64", "bits8", "__class__", "float", ["x"]]
)
def test_a_header_naming_a_dtype_that_cannot_travel_is_rejected(name):
    messages = encode_version(0, [("w", torch.zeros(4))])
    header = msgpack.unpackb(messages[0][0][HEADER_AT:])
    header["tensors"][0]["dtype"] = name
    with pytest.raises(RejectedMessage, match="unknown dtype"):
        VersionAssembler().feed([VERSION_TOPIC + seal(msgpack.packb(header)), messages[0][1]])
