"""ULP deltas + zstd (asyncfp8/sync/delta.py): lossless for every dtype, whole when that
is smaller, and never fooled by streams that do not add up."""

import random
import sys

import numpy as np
import pytest
import torch
import zstandard

from asyncfp8.sync import RejectedMessage, decode_version, encode_version
from asyncfp8.sync.codec import encode_tagged, tag_sections
from asyncfp8.sync.delta import (
    PROBE,
    _apply_numpy,
    _clearly_whole_numpy,
    _compiled,
    _scan_numpy,
    apply_delta,
    clearly_whole,
    element_view,
    encode_delta,
)

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.int8,
    torch.uint8,
    torch.int64,
    torch.bool,
]


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def changed_copy(base: torch.Tensor, rng: torch.Generator, fraction=0.03) -> torch.Tensor:
    """A few elements moved by ±1 or ±2 in their bits (a ULP step for floats), a few
    replaced by arbitrary bits (the escapes), the last element changed (a tail that
    fills no 8-byte word)."""
    new = base.clone()
    words = element_view(new)
    n = words.size
    index = torch.randperm(n, generator=rng)[: max(1, int(fraction * n))].numpy()
    step = np.where(np.arange(index.size) % 2, 1, 2).astype(np.int64)
    words[index] = ((words[index].astype(np.int64) + step) % (1 << (8 * words.itemsize))).astype(
        words.dtype
    )
    wild = index[:: max(1, index.size // 7)]
    words[wild] = np.frombuffer(random.Random(0).randbytes(wild.size * words.itemsize), words.dtype)
    words[-1] ^= 1
    return new


def random_tensor(dtype: torch.dtype, shape, rng: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), generator=rng)
    tensor = raw.to(torch.uint8).view(dtype).reshape(shape)
    if dtype == torch.bool:
        tensor = tensor.view(torch.uint8).remainder(2).view(torch.bool)
    return tensor


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (7, 13), (256, 64)])
def test_delta_round_trip_is_bit_for_bit_for_every_dtype(dtype, shape):
    rng = torch.Generator().manual_seed(3)
    base = random_tensor(dtype, shape, rng)
    new = changed_copy(base, rng)
    delta = encode_delta(new, base)
    if delta is None:  # tiny tensors: whole is smaller, and that is the rule
        assert new.numel() * new.element_size() <= 64
        return
    assert len(delta.blob) < new.numel() * new.element_size()
    out = apply_delta(
        base, delta.blob, delta.changes, delta.escapes, delta.gap_bytes, delta.raw_bytes
    )
    assert out.dtype == dtype and out.shape == new.shape and bits(out) == bits(new)
    width = element_view(base).itemsize
    expected_changes = int((element_view(new) != element_view(base)).sum())
    assert delta.changes == expected_changes and width in (1, 2, 4)


def test_signed_zeros_nans_and_sign_flips_come_back_exactly():
    base = torch.tensor([0.0, 1.0, float("nan"), -2.0, 5.0] * 400, dtype=torch.bfloat16)
    new = base.clone()
    new[0] = -0.0  # equal as floats, different bits
    new[7] = float("inf")
    new[8] = -new[8]  # a sign flip: far apart as integers, an escape
    new.view(torch.int16)[2] += 1  # another NaN payload
    delta = encode_delta(new, base)
    assert delta is not None and delta.escapes >= 2
    out = apply_delta(
        base, delta.blob, delta.changes, delta.escapes, delta.gap_bytes, delta.raw_bytes
    )
    assert bits(out) == bits(new)


def test_update_base_leaves_the_new_bits_in_the_base_delta_or_not():
    rng = torch.Generator().manual_seed(4)
    base = random_tensor(torch.bfloat16, (64, 33), rng)
    sparse = changed_copy(base, rng)
    kept = base.clone()
    assert encode_delta(sparse, kept, update_base=True) is not None
    assert bits(kept) == bits(sparse)
    dense = random_tensor(torch.bfloat16, (64, 33), rng)
    assert encode_delta(dense, kept, update_base=True) is None  # every element changed
    assert bits(kept) == bits(dense)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.int64], ids=str)
@pytest.mark.parametrize("n", [0, 1, 999, PROBE, 5 * PROBE + 3])
def test_the_compiled_sample_decides_as_the_numpy_one(dtype, n):
    """`clearly_whole` (a numba loop) takes the decision the numpy code took, on sparse
    updates, fresh values, and changes near the threshold (all escapes, or all small)."""
    rng = torch.Generator().manual_seed(n)
    base = random_tensor(dtype, (n,), rng)
    small = base.clone()
    words = element_view(small)
    words[::2] = (words[::2].astype(np.int64) + 3) % (1 << (8 * words.itemsize))
    cases = [base.clone(), random_tensor(dtype, (n,), rng), small]
    if n:
        cases.append(changed_copy(base, rng))
    for fraction in (0.2, 0.45, 0.5, 0.55, 0.8):  # around the threshold (escapes if wide)
        new = base.clone()
        words = element_view(new)
        pick = np.random.default_rng(7).random(words.size) < fraction
        words[pick] ^= np.array(1 << (8 * words.itemsize - 2), dtype=words.dtype)
        cases.append(new)
    decisions = []
    for new in cases:
        a, b = element_view(new), element_view(base)
        decisions.append(clearly_whole(a, b))
        assert decisions[-1] == _clearly_whole_numpy(a, b)
    if n > 999:
        assert decisions[:2] == [False, True] and decisions[-1] and not decisions[-5]


def test_a_sending_base_holds_every_version_bit_for_bit_and_payloads_share_it():
    """`encode_tagged` with `update_base` and `share_base` (the publisher): whole tensors
    are copied into the base and their messages in one pass, a chunk that is one slice of
    one tensor is a view of the base; after every version, full or delta, the base holds
    its bits exactly, and the messages decode to it."""
    rng = torch.Generator().manual_seed(6)
    shapes = {"embed": (300, 64), "w.a": (40, 64), "w.b": (7, 13), "scale": (), "big": (5000,)}
    state = {k: random_tensor(torch.bfloat16, s, rng) for k, s in shapes.items()}
    state["e4m3"] = random_tensor(torch.float8_e4m3fn, (77, 31), rng)
    sender: dict[str, torch.Tensor] = {}
    receiver, receiver_version, shared = None, None, 0
    plan = ["new", "step", "step", "new", "step", "grow", "step"]
    for number, made in enumerate(plan):
        if made == "new":
            state = {k: random_tensor(v.dtype, tuple(v.shape), rng) for k, v in state.items()}
        elif made == "step":
            state = {k: changed_copy(v, rng, fraction=0.02) for k, v in state.items()}
        else:  # a tensor the base does not have yet
            state["late"] = random_tensor(torch.bfloat16, (3000,), rng)
        messages = list(
            encode_tagged(
                number,
                tag_sections(state.items(), None),
                base=sender,
                base_version=number - 1 if number else None,
                update_base=True,
                share_base=True,
                chunk_bytes=4096,
            )
        )
        assert {k: bits(v) for k, v in sender.items()} == {k: bits(v) for k, v in state.items()}
        for _, payload in messages:
            if len(payload) and isinstance(payload, memoryview):
                at = np.frombuffer(payload, np.uint8)
                shared += any(np.shares_memory(at, element_view(t)) for t in sender.values())
        version = decode_version(messages, base=receiver, base_version=receiver_version)
        assert {k: bits(v) for k, v in version.weights.items()} == {
            k: bits(v) for k, v in state.items()
        }
        receiver, receiver_version = version.weights, number
    assert shared  # the zero-copy path was taken


def test_versions_of_every_policy_dtype_survive_fifty_delta_rounds():
    """The codec alone, 50 versions of mixed dtypes, each decoded against the previous."""
    rng = torch.Generator().manual_seed(5)
    state = {
        "w.bf16": random_tensor(torch.bfloat16, (96, 40), rng),
        "w.e4m3": random_tensor(torch.float8_e4m3fn, (128, 40), rng),
        "w.scale_inv": random_tensor(torch.float32, (1, 1), rng),
        "w.int8": random_tensor(torch.int8, (100, 30), rng),
    }
    sender = {k: v.clone() for k, v in state.items()}
    receiver, receiver_version = None, None
    for number in range(50):
        if number:
            state = {k: changed_copy(v, rng, fraction=0.01) for k, v in state.items()}
        messages = encode_version(
            number,
            state.items(),
            {"k_scale": torch.tensor(float(number))},
            base=sender if number else None,
            base_version=number - 1 if number else None,
            update_base=True,
            chunk_bytes=3000,
        )
        version = decode_version(messages, base=receiver, base_version=receiver_version)
        assert {k: bits(v) for k, v in version.weights.items()} == {
            k: bits(v) for k, v in state.items()
        }
        assert float(version.extra["k_scale"]) == number
        receiver, receiver_version = version.weights | version.extra, number


def test_malformed_streams_are_rejected_never_applied_out_of_bounds():
    base = torch.zeros(1000, dtype=torch.bfloat16)
    rng = random.Random(6)
    compress = zstandard.ZstdCompressor().compress
    for _ in range(300):
        escapes = rng.randrange(0, 4)
        changes = escapes + rng.randrange(0, 40)
        gap_bytes = rng.randrange(0, 60)
        raw = rng.randbytes(escapes * 2 + changes + gap_bytes)
        blob = compress(raw) if rng.random() < 0.8 else rng.randbytes(40)
        declared = len(raw) + rng.choice([0, 0, 0, 1, -1])
        try:
            out = apply_delta(base, blob, changes, escapes, gap_bytes, declared)
        except RejectedMessage:
            continue
        assert out.shape == base.shape  # well-formed by chance: it applied inside the tensor
    with pytest.raises(RejectedMessage, match="exceed the tensor"):
        apply_delta(base, b"", 2000, 0, 0, 2000)
    big_gap = bytes([0xFF] * 9 + [0x01])  # a varint past any index of the tensor
    blob = compress(bytes([1]) + big_gap)
    with pytest.raises(RejectedMessage, match="outside the tensor"):
        apply_delta(base, blob, 1, 0, len(big_gap), 1 + len(big_gap))


# --- without numba (the GPU machine): the numpy twins -----------------------------------------


def scan_with(scan, new: torch.Tensor, base: torch.Tensor, budget: int, update_base=False):
    """(result, escapes, deltas, gaps, base bits after) of one scan implementation."""
    a, b = element_view(new.contiguous()), element_view(base)
    words = (a.size * a.itemsize) // 8
    words_a, words_b = (
        a[: words * 8 // a.itemsize].view(np.uint64),
        b[: words * 8 // b.itemsize].view(np.uint64),
    )
    escapes = np.zeros(a.size, dtype=a.dtype)
    deltas = np.zeros(a.size, dtype=np.int8)
    gaps = np.zeros(a.size * a.itemsize + 16, dtype=np.uint8)
    result = scan(a, b, words_a, words_b, escapes, deltas, gaps, budget, update_base)
    changes, n_escapes, gap_bytes = result
    streams = (
        escapes[:n_escapes].tobytes(),
        deltas[: max(changes, 0)].tobytes(),
        gaps[:gap_bytes].tobytes(),
    )
    return result, streams, bits(base)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float64], ids=str
)
@pytest.mark.parametrize("n", [1, 7, 1000, 70000])
def test_the_numpy_scan_writes_the_compiled_scans_streams(dtype, n):
    """Sparse updates, long runs without a change (varint gaps of 2 and 3 bytes), dense
    rewrites (over the budget), with and without updating the base."""
    scan, _, _ = _compiled()
    rng = torch.Generator().manual_seed(n)
    base = random_tensor(dtype, (n,), rng)
    sparse = changed_copy(base, rng, fraction=0.002)
    cases = [base.clone(), sparse, changed_copy(base, rng), random_tensor(dtype, (n,), rng)]
    full = n * base.element_size()
    for new in cases:
        for update_base in (False, True):
            compiled = scan_with(scan, new, base.clone(), full, update_base)
            twin = scan_with(_scan_numpy, new, base.clone(), full, update_base)
            if compiled[0][0] < 0:  # over the budget: only the verdict (and the base) count
                assert twin[0][0] < 0 and (not update_base or twin[2] == bits(new))
            else:
                assert twin[:2] == compiled[:2] and twin[2] == compiled[2]


def test_the_numpy_apply_accepts_and_refuses_what_the_compiled_one_does():
    _, apply, _ = _compiled()
    rng = torch.Generator().manual_seed(8)
    base = random_tensor(torch.bfloat16, (5000,), rng)
    new = changed_copy(base, rng, fraction=0.01)
    _, (escapes, deltas, gaps), _ = scan_with(_scan_numpy, new, base, 10**6)
    width = element_view(base).itemsize
    good = (escapes, deltas, gaps)
    draws = random.Random(9)
    variants = [good]
    for _ in range(200):  # corrupt one stream: a byte changed, one dropped, one added
        which = draws.randrange(3)
        stream = bytearray(good[which])
        how = draws.randrange(3)
        if how == 0 and stream:
            stream[draws.randrange(len(stream))] = draws.randrange(256)
        elif how == 1 and stream:
            del stream[draws.randrange(len(stream))]
        else:
            stream.insert(draws.randrange(len(stream) + 1), draws.randrange(256))
        if which == 0:
            stream = stream[: len(stream) // width * width]
        variants.append(tuple(bytes(stream) if i == which else good[i] for i in range(3)))
    views = (element_view(base).dtype, np.int8, np.uint8)
    outcomes = set()
    for streams in variants:
        arrays = [np.frombuffer(s, dtype=v) for s, v in zip(streams, views, strict=True)]
        compiled_out, twin_out = element_view(base).copy(), element_view(base).copy()
        accepted = apply(compiled_out, *arrays)
        assert _apply_numpy(twin_out, *arrays) == accepted
        if accepted:
            assert np.array_equal(twin_out, compiled_out)
        outcomes.add(accepted)
    assert outcomes == {True, False}


def test_without_numba_deltas_are_the_same_bytes_and_round_trip(monkeypatch):
    """Where numba is not installed (the GPU machine) the numpy twins make the same blob."""
    rng = torch.Generator().manual_seed(10)
    base = random_tensor(torch.bfloat16, (300, 70), rng)
    new = changed_copy(base, rng)
    compiled = encode_delta(new, base)
    try:
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, "numba", None)  # `import numba` fails
            _compiled.cache_clear()
            assert _compiled()[0] is _scan_numpy
            delta = encode_delta(new, base)
            out = apply_delta(
                base, delta.blob, delta.changes, delta.escapes, delta.gap_bytes, delta.raw_bytes
            )
    finally:
        _compiled.cache_clear()
    assert delta == compiled and bits(out) == bits(new)
