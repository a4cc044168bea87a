"""Weight sync at the size of Qwen2.5-0.5B, one transport per run: bytes on the wire,
publish → applied time, and throughput against memcpy and bare ZeroMQ measured in the
same run.

    python bench/sync.py --transport shm [--precision bf16 fp8] [--out ...]
    python bench/sync.py --transport tcp [--precision bf16 fp8] [--out ...]

The learner side holds FP32 master weights with Qwen2.5-0.5B's shapes (random values)
and takes simulated Adam steps (update lr·u, u ~ N(0, 1): Adam's normalized step), so
the fraction of BF16 elements that change is what the BF16 cast really leaves. Each
version is cast to BF16 first (the learner's snapshot, on its own thread), then timed
from `VersionPublisher.publish` (the policy's quantization included) until a
`VersionSubscriber` in another process has it verified in its tensors.

Versions, per precision: over shared memory every version goes whole (deltas are for
the network); the first two allocate the receiver's buffers, later ones land in
buffers it already has. Over TCP, versions 0-4 are whole (new random weights each:
the receiver's buffers exist from version 2 on, so three preallocated full versions make
the median), 5-7 deltas after one step at `--lr`.
Throughput = model bytes in BF16 / (publish start → applied). memcpy = one `copy_` of
that many bytes; bare ZeroMQ = PUSH → PULL of the model in `--chunk-mb` frames between
two processes, received into a preallocated buffer (`recv_into`), the ceiling any
protocol on these sockets has here. `encode_gb_per_s`: model bytes / time to encode the
version's chunks against the previous version (deltas, zstd, checksums), in-process.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_seconds, write_json

from asyncfp8.precision import get_policy
from asyncfp8.sync import VersionPublisher, VersionSubscriber, encode_version

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


def random_master() -> dict[str, torch.Tensor]:
    return {
        name: torch.randn(shape) * (0.02 if len(shape) == 2 else 1.0)
        for name, shape in qwen05b_shapes()
    }


def subscriber_process(publish_address, snapshot_address, transport, versions, reports):
    torch.set_num_threads(1)
    subscriber = VersionSubscriber(publish_address, snapshot_address, transport=transport)
    reports.put(("ready", None))
    received = 0
    while received < versions:
        version = subscriber.poll(timeout_ms=100)
        if version is not None:
            reports.put(
                ("applied", (version.number, time.time(), version.wire_bytes, version.transport))
            )
            received += 1
    reports.put(("rejected", (subscriber.rejected, subscriber.fallback_reason)))
    subscriber.close()


def memcpy_bandwidth(nbytes: int) -> float:
    """GB/s of one `copy_` of `nbytes` (counting the bytes copied once)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    return nbytes / median_seconds(lambda: dst.copy_(src), repeats=3) / 1e9


def zmq_sink(address, messages, chunk_bytes, reports):
    import numpy as np
    import zmq

    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.connect(address)
    buffer = np.empty(chunk_bytes, dtype=np.uint8)
    reports.put(("ready", None))
    for _ in range(messages):
        socket.recv_into(buffer)
    reports.put(("done", time.time()))


def zmq_ceiling(context, nbytes: int, chunk_bytes: int) -> float:
    """GB/s of bare ZeroMQ PUSH -> PULL of `nbytes` between two processes on loopback TCP,
    in frames of `chunk_bytes` received into one preallocated buffer."""
    import numpy as np
    import zmq

    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.bind("tcp://127.0.0.1:*")
    reports, messages = context.Queue(), max(1, nbytes // chunk_bytes)
    sink = context.Process(
        target=zmq_sink,
        args=(socket.getsockopt_string(zmq.LAST_ENDPOINT), messages, chunk_bytes, reports),
    )
    sink.start()
    reports.get(timeout=120)
    time.sleep(0.5)
    buffer = np.ones(chunk_bytes, dtype=np.uint8)
    started = time.time()
    for _ in range(messages):
        socket.send(buffer, copy=False)
    finished = reports.get(timeout=300)[1]
    sink.join(timeout=30)
    socket.close()
    return messages * chunk_bytes / (finished - started) / 1e9


def versions_for(transport: str) -> list[str]:
    """What each version is made of: fresh random weights ("new") or one Adam step."""
    return ["new"] * 4 if transport == "shm" else ["new"] * 5 + ["step"] * 3


def run_precision(args, precision, context, memcpy, ceiling, model_bytes) -> list[dict]:
    torch.manual_seed(0)
    policy = get_policy(precision)
    plan = versions_for(args.transport)
    publisher = VersionPublisher(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        chunk_bytes=args.chunk_mb << 20,
        transport=args.transport,
        zstd_level=args.zstd_level,
    )
    reports = context.Queue()
    child = context.Process(
        target=subscriber_process,
        args=(
            publisher.publish_address,
            publisher.snapshot_address,
            args.transport,
            len(plan),
            reports,
        ),
    )
    child.start()
    assert reports.get(timeout=120)[0] == "ready"
    time.sleep(1.0)  # the SUB connection (and its subscription) is up before the first publish
    rows, previous = [], None
    master = random_master()
    for number, made in enumerate(plan):
        changed = None
        if made == "new" and number:
            master = random_master()
        elif made == "step":
            before = {n: t.to(torch.bfloat16) for n, t in master.items()}
            for tensor in master.values():
                tensor.add_(torch.randn_like(tensor), alpha=-args.lr)
            changed = sum(
                (before[n] != t.to(torch.bfloat16)).sum().item() for n, t in master.items()
            )
            del before
        snapshot = [(n, t.to(torch.bfloat16)) for n, t in master.items()]
        quantized = dict(policy.quantize_weights(snapshot))
        started = time.perf_counter()
        encode_version(number, quantized.items(), base=previous, chunk_bytes=args.chunk_mb << 20)
        encode_seconds = time.perf_counter() - started
        previous = {n: t.clone() for n, t in quantized.items()}
        del quantized
        started = time.time()
        stats = publisher.publish(number, policy.quantize_weights(snapshot), policy=policy.name)
        kind, (applied_number, applied_at, received_bytes, medium) = reports.get(timeout=600)
        assert kind == "applied" and applied_number == number, (kind, applied_number)
        seconds = applied_at - started
        rows.append(
            {
                "transport": medium,
                "precision": policy.name,
                "version": number,
                "kind": "delta" if made == "step" else "full",
                "receiver_buffers": "preallocated" if number >= 2 else "allocated",
                "wire_bytes": received_bytes,
                "changed_fraction": None if changed is None else changed / (model_bytes // 2),
                "publish_seconds": stats.seconds,
                "end_to_end_seconds": seconds,
                "gb_per_s": model_bytes / seconds / 1e9,
                "fraction_of_memcpy": model_bytes / seconds / 1e9 / memcpy,
                "fraction_of_zmq": model_bytes / seconds / 1e9 / ceiling,
                "encode_gb_per_s": model_bytes / encode_seconds / 1e9,
            }
        )
        print(
            f"{policy.name:>5} v{number} {rows[-1]['kind']:<5} {medium} "
            f"{received_bytes / 1e6:9.2f} MB  publish {stats.seconds:6.2f} s  "
            f"e2e {seconds:6.2f} s  {100 * rows[-1]['fraction_of_memcpy']:5.1f}% of memcpy  "
            f"{100 * rows[-1]['fraction_of_zmq']:5.1f}% of zmq  "
            f"encode {rows[-1]['encode_gb_per_s']:.2f} GB/s",
            flush=True,
        )
    kind, (rejected, fallback) = reports.get(timeout=60)
    child.join(timeout=30)
    publisher.close()
    for row in rows:
        row["rejected"], row["fallback"] = rejected, fallback
    return rows


def summary(rows: list[dict], full_bf16: int) -> dict:
    """Medians of the rows that measure what the targets are about."""
    out = {}
    for precision in sorted({r["precision"] for r in rows}):
        mine = [r for r in rows if r["precision"] == precision]
        full = [r for r in mine if r["kind"] == "full" and r["receiver_buffers"] == "preallocated"]
        deltas = [r for r in mine if r["kind"] == "delta"]
        entry = {}
        if full:
            entry["full_fraction_of_memcpy"] = statistics.median(
                r["fraction_of_memcpy"] for r in full
            )
            entry["full_fraction_of_zmq"] = statistics.median(r["fraction_of_zmq"] for r in full)
            entry["full_wire_bytes"] = statistics.median(r["wire_bytes"] for r in full)
        if deltas:
            entry["delta_wire_bytes"] = statistics.median(r["wire_bytes"] for r in deltas)
            entry["delta_times_smaller_than_full_bf16"] = full_bf16 / entry["delta_wire_bytes"]
            entry["delta_encode_gb_per_s"] = statistics.median(r["encode_gb_per_s"] for r in deltas)
            entry["delta_end_to_end_seconds"] = statistics.median(
                r["end_to_end_seconds"] for r in deltas
            )
        out[precision] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=["shm", "tcp"], required=True)
    parser.add_argument("--precision", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--chunk-mb", type=int, default=4)
    parser.add_argument("--zstd-level", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    model_bytes = sum(2 * torch.Size(shape).numel() for _, shape in qwen05b_shapes())
    memcpy = memcpy_bandwidth(model_bytes)
    context = mp.get_context("spawn")
    ceiling = zmq_ceiling(context, model_bytes, args.chunk_mb << 20)
    print(
        f"Qwen2.5-0.5B shapes, {model_bytes / 1e9:.2f} GB in BF16, transport {args.transport}; "
        f"memcpy {memcpy:.1f} GB/s; bare ZeroMQ (TCP loopback, {args.chunk_mb} MiB frames, "
        f"recv_into) {ceiling:.2f} GB/s",
        flush=True,
    )
    rows = []
    for precision in args.precision:
        rows += run_precision(args, precision, context, memcpy, ceiling, model_bytes)
    full_bf16 = model_bytes  # a whole BF16 version's tensor bytes (headers add ~0.01%)
    result = summary(rows, full_bf16)
    for precision, entry in result.items():
        print(precision, {k: round(v, 3) for k, v in entry.items()})
    path = write_json(
        args.out or f"bench/results/sync-{args.transport}.json",
        {
            "transport": args.transport,
            "model_bytes": model_bytes,
            "memcpy_gb_per_s": memcpy,
            "zmq_loopback_gb_per_s": ceiling,
            "lr": args.lr,
            "chunk_mb": args.chunk_mb,
            "zstd_level": args.zstd_level,
            "summary": result,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
