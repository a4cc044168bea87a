"""Weight sync on loopback at the size of Qwen2.5-0.5B: bytes on the wire, publish →
applied time, and throughput against memcpy, measured in one run.

    python bench/sync.py [--versions 4] [--lr 1e-6] [--precision bf16] [--out ...]

The learner side holds FP32 master weights with Qwen2.5-0.5B's shapes (random values)
and takes simulated Adam steps (update lr·u, u ~ N(0, 1): Adam's normalized step), so
the fraction of BF16 elements that change is what the BF16 cast really leaves. Each
version goes through the precision policy and a VersionPublisher; a VersionSubscriber
in another process receives, verifies and rebuilds it, and reports when it is applied.
Throughput = model bytes (BF16) / (publish start → applied; the FP32 → BF16 cast
included), against memcpy = model bytes / time of one `copy_` of that many bytes, and
against bare ZeroMQ (PUSH → PULL of 1 GiB in 64 MiB messages between two processes on
loopback TCP), the ceiling any protocol over these sockets has on this machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_seconds, write_json

from asyncfp8.precision import get_policy
from asyncfp8.sync import VersionPublisher, VersionSubscriber

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, KV = 151936, 896, 4864, 24, 128


def qwen05b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]  # tied with the LM head
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (HIDDEN,)),
            (f"{p}.self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (f"{p}.self_attn.q_proj.bias", (HIDDEN,)),
            (f"{p}.self_attn.k_proj.weight", (KV, HIDDEN)),
            (f"{p}.self_attn.k_proj.bias", (KV,)),
            (f"{p}.self_attn.v_proj.weight", (KV, HIDDEN)),
            (f"{p}.self_attn.v_proj.bias", (KV,)),
            (f"{p}.self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
            (f"{p}.mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
        ]
    return [*shapes, ("model.norm.weight", (HIDDEN,))]


def subscriber_process(publish_address, snapshot_address, versions, reports):
    torch.set_num_threads(1)
    subscriber = VersionSubscriber(publish_address, snapshot_address)
    reports.put(("ready", None))
    received = 0
    while received < versions:
        version = subscriber.poll(timeout_ms=100)
        if version is not None:
            reports.put(("applied", (version.number, time.time(), version.wire_bytes)))
            received += 1
    reports.put(("rejected", subscriber.rejected))
    subscriber.close()


def memcpy_bandwidth(nbytes: int) -> float:
    """GB/s of one `copy_` of `nbytes` (counting the bytes copied once)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    return nbytes / median_seconds(lambda: dst.copy_(src), repeats=3) / 1e9


def zmq_sink(address, messages, reports):
    import zmq

    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.connect(address)
    reports.put(("ready", None))
    for _ in range(messages):
        socket.recv(copy=False)
    reports.put(("done", time.time()))


def zmq_ceiling(context, megabytes: int = 1024, chunk_mb: int = 64) -> float:
    """GB/s of bare ZeroMQ PUSH -> PULL between two processes on loopback TCP."""
    import numpy as np
    import zmq

    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.bind("tcp://127.0.0.1:*")
    reports, messages = context.Queue(), megabytes // chunk_mb
    sink = context.Process(
        target=zmq_sink, args=(socket.getsockopt_string(zmq.LAST_ENDPOINT), messages, reports)
    )
    sink.start()
    reports.get(timeout=120)
    time.sleep(0.5)
    buffer = np.ones(chunk_mb << 20, dtype=np.uint8)
    started = time.time()
    for _ in range(messages):
        socket.send(buffer, copy=False)
    finished = reports.get(timeout=300)[1]
    sink.join(timeout=30)
    socket.close()
    return messages * (chunk_mb << 20) / (finished - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--chunk-mb", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    policy = get_policy(args.precision)
    master = {
        name: torch.randn(shape) * (0.02 if len(shape) == 2 else 1.0)
        for name, shape in qwen05b_shapes()
    }
    model_bytes = sum(t.numel() * 2 for t in master.values())  # BF16, before quantization

    memcpy = memcpy_bandwidth(model_bytes)

    context = mp.get_context("spawn")
    ceiling = zmq_ceiling(context)
    publisher = VersionPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", chunk_bytes=args.chunk_mb << 20
    )
    reports = context.Queue()
    child = context.Process(
        target=subscriber_process,
        args=(publisher.publish_address, publisher.snapshot_address, args.versions, reports),
    )
    child.start()
    assert reports.get(timeout=120)[0] == "ready"
    time.sleep(1.0)  # the SUB connection is up before the first publish

    rows = []
    for number in range(args.versions):
        changed = None
        if number:
            before = {n: t.to(torch.bfloat16) for n, t in master.items()}
            for tensor in master.values():
                tensor.add_(torch.randn_like(tensor), alpha=-args.lr)
            changed = sum(
                (before[n] != t.to(torch.bfloat16)).sum().item() for n, t in master.items()
            )
            del before
        started = time.time()
        # The BF16 cast makes fresh tensors: the publisher need not copy them again.
        stats = publisher.publish(
            number,
            policy.quantize_weights((n, t.to(torch.bfloat16)) for n, t in master.items()),
            policy=policy.name,
            copy=False,
        )
        kind, (applied_number, applied_at, _) = reports.get(timeout=600)
        assert kind == "applied" and applied_number == number
        seconds = applied_at - started
        rows.append(
            {
                "version": number,
                "kind": "full" if number == 0 else "delta",
                "wire_bytes": stats.wire_bytes,
                "changed_fraction": None if changed is None else changed / (model_bytes // 2),
                "publish_seconds": stats.seconds,
                "end_to_end_seconds": seconds,
                "gb_per_s": model_bytes / seconds / 1e9,
                "fraction_of_memcpy": model_bytes / seconds / 1e9 / memcpy,
                "fraction_of_zmq": model_bytes / seconds / 1e9 / ceiling,
            }
        )
    kind, rejected = reports.get(timeout=60)
    child.join(timeout=30)
    publisher.close()

    full = rows[0]["wire_bytes"]
    print(
        f"Qwen2.5-0.5B shapes, {model_bytes / 1e9:.2f} GB in BF16, precision {policy.name}, lr {args.lr}; "
        f"memcpy {memcpy:.1f} GB/s; bare ZeroMQ over loopback TCP {ceiling:.2f} GB/s; subscriber rejected {rejected}"
    )
    print(
        f"{'v':>2} {'kind':<5} {'wire MB':>9} {'x smaller':>9} {'changed':>8} {'publish s':>9} {'e2e s':>7} {'GB/s':>6} {'of memcpy':>9} {'of zmq':>7}"
    )
    for row in rows:
        changed = "" if row["changed_fraction"] is None else f"{100 * row['changed_fraction']:.2f}%"
        print(
            f"{row['version']:>2} {row['kind']:<5} {row['wire_bytes'] / 1e6:>9.1f} {full / row['wire_bytes']:>9.1f} "
            f"{changed:>8} {row['publish_seconds']:>9.2f} {row['end_to_end_seconds']:>7.2f} {row['gb_per_s']:>6.2f} "
            f"{100 * row['fraction_of_memcpy']:>8.1f}% {100 * row['fraction_of_zmq']:>6.1f}%"
        )
    path = write_json(
        args.out or f"bench/results/sync-{policy.name}.json",
        {
            "model_bytes": model_bytes,
            "memcpy_gb_per_s": memcpy,
            "zmq_loopback_gb_per_s": ceiling,
            "lr": args.lr,
            "precision": policy.name,
            "chunk_mb": args.chunk_mb,
            "rejected": rejected,
            "versions": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
