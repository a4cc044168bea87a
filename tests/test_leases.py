"""The lease book (which prompts go where, and the staleness bound) and the lease
messages on the trajectory channel."""

import time

import msgpack
import pytest
import zmq

from asyncfp8.learner.leases import LeaseBook
from asyncfp8.sync import TrajectoryReceiver, TrajectorySender
from asyncfp8.sync.codec import seal
from asyncfp8.sync.trajectories import LEASE_FRAME

LOOPBACK = "tcp://127.0.0.1:*"


def test_capacity_bounds_open_groups_and_training_frees_it():
    book = LeaseBook(capacity=6, timeout=60)
    first = book.grant("w0", 4, version=0, now=0.0)
    second = book.grant("w1", 4, version=0, now=0.0)
    assert first.prompts == [0, 1, 2, 3] and second.prompts == [4, 5]  # only 2 fit
    assert book.grant("w0", 1, version=0, now=0.0) is None  # the bound says wait
    for prompt in first.prompts:
        assert book.returned(first.id, prompt)
    assert book.grant("w0", 1, version=1, now=0.0) is None  # returned is not yet trained
    book.close(4)
    third = book.grant("w0", 8, version=1, now=0.0)
    assert third.prompts == [6, 7, 8, 9] and third.min_version == 1
    with pytest.raises(ValueError, match="only"):
        book.close(100)


def test_a_group_is_owed_once_and_not_after_its_lease_expired():
    book = LeaseBook(capacity=8, timeout=10)
    lease = book.grant("w0", 3, version=0, now=0.0)
    assert book.returned(lease.id, 1)
    assert not book.returned(lease.id, 1)  # twice
    assert not book.returned(lease.id, 99)  # never leased
    expired = book.expire(now=11.0)
    assert [e.id for e in expired] == [lease.id]
    assert book.open_groups == 1 and book.expired_groups == 2  # the returned one stays open
    assert not book.returned(lease.id, 0)  # late
    again = book.grant("w1", 3, version=2, now=12.0)
    assert again.prompts == [0, 2, 3]  # the dead worker's prompts first, then new ones


def test_state_dict_round_trip_keeps_data_position_and_leases():
    book = LeaseBook(capacity=8, timeout=10)
    lease = book.grant("w0", 3, version=0, now=0.0)
    book.returned(lease.id, 0)
    book.grant("w1", 2, version=0, now=0.0)
    book.expire(now=0.0)  # nothing overdue yet
    restored = LeaseBook(capacity=8, timeout=10)
    restored.load_state_dict(book.state_dict(), now=100.0)
    assert restored.next_prompt == 5 and restored.open_groups == book.open_groups
    assert restored.returned(lease.id, 1)  # a worker resending after the restart is owed
    assert restored.expire(now=105.0) == []  # restored leases get a fresh clock


def test_lease_requests_are_answered_and_bad_ones_rejected_while_serving():
    context = zmq.Context()
    asked = []

    def on_lease(request):
        asked.append(request)
        return {"lease": 7, "prompts": [1, 2], "min_version": 3}

    receiver = TrajectoryReceiver(LOOPBACK, context=context, on_lease=on_lease)
    sender = TrajectorySender(receiver.address, "w0", context=context)
    intruder = context.socket(zmq.DEALER)
    intruder.connect(receiver.address)
    try:
        bad = [
            [LEASE_FRAME, b"garbage"],
            [LEASE_FRAME, seal(msgpack.packb({"format": 1, "want": 5}))],
            [
                LEASE_FRAME,
                seal(
                    msgpack.packb(
                        {
                            "format": 1,
                            "sender": "x",
                            "worker_id": "x",
                            "want": -1,
                            "version": None,
                            "stats": {},
                        }
                    )
                ),
            ],
        ]
        for frames in bad:
            intruder.send_multipart(frames)
        sender.request_lease(2, version=3, stats={"tokens": 10})
        deadline = time.monotonic() + 10
        while not sender.replies and time.monotonic() < deadline:
            receiver.poll(timeout_ms=50)
            sender.pump(timeout_ms=10)
        assert sender.replies.popleft() == {
            "lease": 7,
            "prompts": [1, 2],
            "min_version": 3,
            "kind": "lease",
        }
        # The intruder's frames come on another connection: fair queueing may serve the
        # worker's request first (seen under load), so wait for them too.
        while receiver.rejected < 3 and time.monotonic() < deadline:
            receiver.poll(timeout_ms=50)
        assert receiver.rejected == 3 and len(asked) == 1
        assert asked[0]["want"] == 2 and asked[0]["stats"] == {"tokens": 10.0}
    finally:
        intruder.close()
        sender.close()
        receiver.close()
        context.term()


def test_a_resumed_book_never_reuses_a_lease_id_of_its_predecessor():
    dead = LeaseBook(capacity=8, timeout=10)
    saved = dead.state_dict()  # the checkpoint
    after_checkpoint = dead.grant("w0", 2, version=5, now=0.0)  # granted, then the learner died
    resumed = LeaseBook(capacity=8, timeout=10)
    resumed.load_state_dict(saved, now=1.0)
    fresh = resumed.grant("w0", 2, version=6, now=1.0)
    assert fresh.prompts == after_checkpoint.prompts  # the data position is the checkpoint's
    assert fresh.serial == after_checkpoint.serial  # so is the sampling seed
    assert fresh.id != after_checkpoint.id
    assert not resumed.returned(after_checkpoint.id, after_checkpoint.prompts[0])  # not owed


def test_a_dropped_stale_group_frees_capacity_and_its_prompt_comes_back_first():
    book = LeaseBook(capacity=2, timeout=10, incarnation=0)
    lease = book.grant("w", 2, version=0, now=0.0)
    assert book.grant("w", 1, version=0, now=0.0) is None
    assert book.returned(lease.id, 0) and book.returned(lease.id, 1)
    book.dropped(0)  # prompt 0's group came back too stale to train
    again = book.grant("w", 2, version=3, now=1.0)
    assert again.prompts == [0]  # capacity for one group: the dropped prompt, before new ones
    book.close(1)  # prompt 1 trained
    assert book.grant("w", 2, version=3, now=1.0).prompts == [2]


def test_a_resumed_colocated_inbox_expires_the_leases_its_rollout_thread_held():
    from asyncfp8.learner.inbox import Inbox
    from asyncfp8.sync import Trajectory

    sampling = {"n": 2, "temperature": 1.0, "max_new_tokens": 4}
    inbox = Inbox(None, LeaseBook(capacity=4, timeout=120), 2, sampling, 0, None)
    inbox.trained(0, 1)
    held = inbox.lease("colocated", 2, {})
    assert held["prompts"] == [0, 1]
    half = Trajectory(
        [1], [2], [-0.1], [1], 1.0, "g", prompt_index=0, meta={"lease": held["lease"]}
    )
    inbox.deliver([half])  # one sample of prompt 0's group of 2 had arrived
    state = inbox.state_dict()

    resumed = Inbox(None, LeaseBook(capacity=4, timeout=120), 2, sampling, 0, None)
    resumed.load_state_dict(state)
    expired = resumed.expire_all()
    assert [lease.id for lease in expired] == [held["lease"]]
    assert resumed.partial == {} and resumed.book.open_groups == 0
    resumed.trained(0, 1)
    # Its prompts come back first, and the whole capacity is free again.
    assert resumed.lease("colocated", 4, {})["prompts"] == [0, 1, 2, 3]


def test_a_waiting_rollout_thread_wakes_when_a_step_frees_capacity():
    import threading

    from asyncfp8.learner.inbox import Inbox

    sampling = {"n": 2, "temperature": 1.0, "max_new_tokens": 4}
    inbox = Inbox(None, LeaseBook(capacity=2, timeout=120), 2, sampling, 0, None)
    inbox.trained(0, 1)
    inbox.lease("colocated", 2, {})  # the book is full
    step = threading.Timer(0.03, inbox.trained, args=(2, 2))  # a step trains them
    step.start()
    started = time.monotonic()
    answer = inbox.lease_or_wait("colocated", 2, {})
    waited = time.monotonic() - started
    step.join()
    # It waited for the change, not for the answer's whole wait.
    assert "wait" in answer and 0.02 < waited < answer["wait"] * 0.75
    assert inbox.lease("colocated", 2, {})["min_version"] == 2
