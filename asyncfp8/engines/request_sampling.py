"""Per-request random streams: a sample's tokens depend on its seed only (not its slot,
its batch, when it started). Each draw is a pure function of (request seed, token index),
a 32-bit hash on the device, one uniform per row, inverse CDF of the processed
distribution: no generator state, the same shapes every step, unlike a generator per row
or a shared one (docs/engines.md, "Slots")."""

from __future__ import annotations

import logging

import torch

from .base import SamplingParams
from .decode import processed_logprobs

MASK32 = 0xFFFFFFFF


def request_seed(seed: int, index: int) -> int:
    """The 63-bit key of request `index` of a call seeded with `seed` (splitmix64 of
    the pair, so nearby seeds and indices give unrelated streams)."""
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x · constant) mod 2^32 for x in [0, 2^32) held in int64, without overflowing
    int64 (whose wrap-around torch does not promise): x split in 16-bit halves."""
    high, low = x >> 16, x & 0xFFFF
    return ((((high * constant) & 0xFFFF) << 16) + low * constant) & MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons): a 32-bit integer bijection with good avalanche."""
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


#: Streams of one request (`uniforms(..., stream=)`): the plain sample of a token, and
#: speculative decoding's draft, acceptance coin and final (resampled or bonus) token.
SAMPLE, DRAFT, COIN, FINAL = 0, 1, 2, 3


def stream_keys(seeds: torch.Tensor, stream: int = SAMPLE) -> torch.Tensor:
    """The 32-bit key of each request's `stream` (int64, in [0, 2^32)) for request keys
    `seeds` (int64, >= 0): what `draw` hashes with a token index. A caller that draws
    every step keeps it per row instead of hashing the seed again each time."""
    lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
    key = _hash32(lo ^ _hash32(hi ^ 0x5BD1E995))
    if stream:  # stream 0's formula is the one seeded outputs were made with
        key = _hash32(key ^ _mul32(torch.full_like(key, stream), 0x9E3779B9))
    return key


def draw(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in [0, 1) per element (53 random bits) for stream keys `keys`
    (from `stream_keys`) at token indices `counters` (same shape, or broadcast)."""
    base = _hash32(keys ^ _hash32(counters & MASK32))
    first = _hash32(base ^ 0x68E31DA4)  # 32 bits
    second = _hash32(base ^ 0xB5297A4D) >> 11  # 21 bits
    return ((first << 21) | second).double() / float(1 << 53)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor, stream: int = SAMPLE) -> torch.Tensor:
    """One float64 uniform in [0, 1) per element (53 random bits) for request keys `seeds`
    (int64, >= 0) at token indices `counters` (same shape, or broadcast), in one of the
    request's independent `stream`s."""
    return draw(stream_keys(seeds, stream), counters)


def sample_per_request(
    logits: torch.Tensor,
    sampling: SamplingParams,
    keys: torch.Tensor,
    counters: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token [B], its processed log-probability [B] fp32) for logits [B, V], row
    i drawn with the uniform of its SAMPLE stream `keys[i]` (`stream_keys`) at token
    index `counters[i]`. Greedy (temperature 0) takes the argmax and draws nothing."""
    logp = processed_logprobs(logits, sampling)
    if sampling.temperature == 0:
        chosen = logp.argmax(-1)
    else:
        chosen = inverse_cdf(logp.double().exp(), draw(keys, counters))
    return chosen, logp.gather(-1, chosen[:, None])[:, 0]


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The index drawn by uniform u [...] from the unnormalized weights [..., V] (>= 0,
    some positive): the first index whose cumulative weight exceeds u · total."""
    cdf = weights.double().cumsum(-1)
    total = cdf[..., -1:]
    # u · total, kept below the total so that rounding never picks the past-the-end
    # index; `right=True` never lands on a token of weight 0 (its cdf equals its
    # predecessor's).
    target = torch.minimum(u.double()[..., None] * total, total.nextafter(cdf.new_zeros(())))
    return torch.searchsorted(cdf, target, right=True)[..., 0]


class CompiledSampler:
    """`sample_per_request` through torch.compile, for the compiled decode step: the
    ~120 eager launches it costs a step (mostly the hash) become a few fused kernels,
    with the same tokens and log-probs. One per process; a compile that fails leaves the
    eager sampler, said once."""

    def __init__(self):
        self.compiled = torch.compile(sample_per_request, fullgraph=True, dynamic=False)
        self.failed = False

    def __call__(self, logits, sampling, keys, counters):
        if not self.failed:
            try:
                return self.compiled(logits, sampling, keys, counters)
            except Exception as err:  # dynamo, inductor or a compiler: every kind may raise
                self.failed = True
                cause = str(err).strip().splitlines()
                logging.getLogger(__name__).warning(
                    "the compiled sampler failed to compile (%s: %s); the eager one runs",
                    type(err).__name__,
                    cause[0][:300] if cause else "",
                )
        return sample_per_request(logits, sampling, keys, counters)


_COMPILED: CompiledSampler | None = None


def step_sampler(compiled: bool):
    """The sampler of a decode step: compiled with a compiled step, else eager."""
    global _COMPILED
    if not compiled:
        return sample_per_request
    if _COMPILED is None:
        _COMPILED = CompiledSampler()
    return _COMPILED
