"""The numba-compiled kernel behind `copyhash.copy_xxh3`, imported on first use only.

XXH3-64 (seed 0, the default secret) of inputs over 240 bytes, as xxhash.h's
`XXH3_hashLong_64b`. Each 64-byte stripe is stored to the destination from the registers it
is hashed from (one read per byte), non-temporally when the destination is 64-byte aligned.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

STRIPES_PER_BLOCK = 16  # (secret size 192 - stripe 64) / 8
BLOCK_WORDS = STRIPES_PER_BLOCK * 8
PRIME32_1 = 0x9E3779B1


def _block_codegen(mode: str):
    """IR for one 1024-byte block: 16 stripes accumulated into `acc` (copied into `dst`
    as `mode` says: "nt" non-temporal, "plain" ordinary stores, "none" not at all),
    then the scramble."""

    def codegen(context, builder, signature, args):
        acc_a, keys_a, src_a, dst_a, word = args
        acc = context.make_array(signature.args[0])(context, builder, acc_a)
        keys = context.make_array(signature.args[1])(context, builder, keys_a)
        src = context.make_array(signature.args[2])(context, builder, src_a)
        dst = context.make_array(signature.args[3])(context, builder, dst_a)
        i64 = ir.IntType(64)
        vector = ir.VectorType(i64, 8)

        def splat(value: int) -> ir.Constant:
            return ir.Constant(vector, [ir.Constant(i64, value)] * 8)

        def vector_at(array, index) -> ir.Value:
            return builder.bitcast(builder.gep(array.data, [index]), vector.as_pointer())

        low32, swap = splat(0xFFFFFFFF), [1, 0, 3, 2, 5, 4, 7, 6]
        swap_mask = ir.Constant(ir.VectorType(ir.IntType(32), 8), swap)
        accumulators = builder.load(vector_at(acc, ir.Constant(i64, 0)), align=8)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        for stripe in range(STRIPES_PER_BLOCK):
            at = builder.add(word, ir.Constant(i64, 8 * stripe))
            data = builder.load(vector_at(src, at), align=8)
            if mode == "nt":
                store = builder.store(data, vector_at(dst, at), align=64)
                store.set_metadata("nontemporal", nontemporal)
            elif mode == "plain":
                builder.store(data, vector_at(dst, at), align=8)
            key = builder.load(vector_at(keys, ir.Constant(i64, stripe)), align=8)
            mixed = builder.xor(data, key)
            product = builder.mul(builder.and_(mixed, low32), builder.lshr(mixed, splat(32)))
            swapped = builder.shuffle_vector(data, ir.Constant(vector, ir.Undefined), swap_mask)
            accumulators = builder.add(builder.add(accumulators, swapped), product)
        scramble_key = builder.load(vector_at(keys, ir.Constant(i64, 16)), align=8)
        accumulators = builder.xor(accumulators, builder.lshr(accumulators, splat(47)))
        accumulators = builder.xor(accumulators, scramble_key)
        accumulators = builder.mul(accumulators, splat(PRIME32_1))
        builder.store(accumulators, vector_at(acc, ir.Constant(i64, 0)), align=8)
        return context.get_dummy_value()

    return codegen


def _block_intrinsic(mode: str):
    def typer(typingctx, acc, keys, src, dst, word):
        return types.void(acc, keys, src, dst, types.int64), _block_codegen(mode)

    typer.__name__ = f"_block_{mode}"
    return intrinsic(typer)


_block_nt = _block_intrinsic("nt")
_block_plain = _block_intrinsic("plain")
_block_none = _block_intrinsic("none")

jit = numba.njit(cache=True, nogil=True, boundscheck=False)


@jit
def _mul128_fold64(a, b):
    m, s = np.uint64(0xFFFFFFFF), np.uint64(32)
    al, ah, bl, bh = a & m, a >> s, b & m, b >> s
    ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh
    cross = (ll >> s) + (lh & m) + hl
    high = hh + (lh >> s) + (cross >> s)
    low = (cross << s) | (ll & m)
    return low ^ high


@jit
def copy_xxh3_long(src, dst, src64, dst64, keys, last_keys, merge_keys, mode):
    """XXH3-64 of `src` (more than 240 bytes), copying it into `dst` unless mode is 2.
    src64 / dst64: the same memory as uint64 words (the whole words of it); mode 0 copies
    with non-temporal stores (dst 64-byte aligned), 1 with ordinary ones, 2 not at all."""
    n = src.size
    m, s32 = np.uint64(0xFFFFFFFF), np.uint64(32)
    acc = np.empty(8, np.uint64)
    acc[0], acc[1] = np.uint64(0xC2B2AE3D), np.uint64(0x9E3779B185EBCA87)
    acc[2], acc[3] = np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9)
    acc[4], acc[5] = np.uint64(0x85EBCA77C2B2AE63), np.uint64(0x85EBCA77)
    acc[6], acc[7] = np.uint64(0x27D4EB2F165667C5), np.uint64(0x9E3779B1)
    blocks = (n - 1) // 1024
    for b in range(blocks):
        if mode == 0:
            _block_nt(acc, keys, src64, dst64, b * BLOCK_WORDS)
        elif mode == 1:
            _block_plain(acc, keys, src64, dst64, b * BLOCK_WORDS)
        else:
            _block_none(acc, keys, src64, dst64, b * BLOCK_WORDS)
    # The last, partial block: whole stripes, then the input's last 64 bytes.
    stripes = ((n - 1) - 1024 * blocks) // 64
    for s in range(stripes):
        w = blocks * BLOCK_WORDS + 8 * s
        for i in range(8):
            x = src64[w + i]
            d = x ^ keys[s + i]
            acc[i ^ 1] += x
            acc[i] += (d & m) * (d >> s32)
    if mode != 2:
        for w in range(blocks * BLOCK_WORDS, src64.size):
            dst64[w] = src64[w]
        for k in range(src64.size * 8, n):
            dst[k] = src[k]
    for i in range(8):
        x = np.uint64(0)
        at = n - 64 + 8 * i
        for j in range(8):
            x |= np.uint64(src[at + j]) << np.uint64(8 * j)
        d = x ^ last_keys[i]
        acc[i ^ 1] += x
        acc[i] += (d & m) * (d >> s32)
    result = np.uint64(n) * np.uint64(0x9E3779B185EBCA87)
    for i in range(4):
        low, high = acc[2 * i] ^ merge_keys[2 * i], acc[2 * i + 1] ^ merge_keys[2 * i + 1]
        result += _mul128_fold64(low, high)
    result ^= result >> np.uint64(37)
    result *= np.uint64(0x165667919E3779F9)
    result ^= result >> np.uint64(32)
    return result
