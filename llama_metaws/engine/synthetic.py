"""Synthetic draft acceptance: llama-server's benchmarking mode (``--spec-synth-rates``, ``--spec-synth-len``).

Verification accepts each draft token at random instead of by its match with the target, so a
model pair runs at any acceptance one asks for (a real-shape model whose head never agrees, at the
acceptance of a trained one). As in llama-server (``server_sample_and_accept_synth``,
``common_speculative_synth_rates_resolve``):

* the rates are unconditional per draft position (``P0 >= P1 >= ...``, one per token of
  ``draft_max``), or a mean acceptance length ``L`` (the target's token included) that resolves
  to the geometric rates ``p, p^2, ...`` whose sum is ``L - 1``; verification takes draft token
  ``i`` with the conditional probability ``rate_i / rate_{i-1}``;
* the target still samples every row it reaches (its sampler's state moves on as it would); a
  draft token taken is accepted by the sampler chain but not by its grammar or reasoning budget,
  which see only what the target samples; a drafted end-of-generation token is never taken; the
  first draft token not taken is replaced by the target's, which ends the step;
* each request has its own random generator, seeded from the request's seed (a random one when
  the request has the default seed): the same seed gives the same acceptance.

The output is not valid text: the draft's tokens are kept whatever the target thought of them.
"""

from __future__ import annotations

import math
import random
from typing import List, Optional, Sequence

__all__ = ["WARNING", "resolve", "conditional", "request_rng", "parse_rates", "parse_length"]

WARNING = "synthetic speculative acceptance is enabled for benchmarking; generated output is not valid"
#: llama.cpp's LLAMA_DEFAULT_SEED: a request without a seed of its own
DEFAULT_SEED = 0xFFFFFFFF


def resolve(rates: Optional[Sequence[float]], length: Optional[float], n_max: int) -> List[float]:
    """The unconditional rates per draft position (empty: synthetic acceptance is off), checked
    as llama.cpp checks them; a ``ValueError`` with its message otherwise. ``n_max``: the longest
    draft (0: no drafting)."""
    has_rates, has_length = rates is not None, length is not None
    if not has_rates and not has_length:
        return []
    if has_rates and has_length:
        raise ValueError("synthetic acceptance length and rates are mutually exclusive")
    if n_max <= 0:
        raise ValueError("synthetic acceptance requires speculative decoding (draft='mtp' or a draft model; "
                         "serve: --spec-type draft-mtp)")
    if has_rates:
        rates = [float(r) for r in rates]
        if len(rates) != n_max:
            raise ValueError(f"synthetic acceptance rates must contain {n_max} values (the draft length at most), "
                             f"got {len(rates)}")
        for i, r in enumerate(rates):
            if not math.isfinite(r) or not 0.0 <= r <= 1.0:
                raise ValueError("synthetic acceptance rates must be finite and within [0, 1]")
            if i > 0 and r > rates[i - 1]:
                raise ValueError("synthetic acceptance rates must be monotonically non-increasing")
        return rates
    length = float(length)
    length_max = n_max + 1.0
    if not math.isfinite(length) or not 1.0 <= length <= length_max:
        raise ValueError(f"synthetic acceptance length must be finite and within [1, {length_max:.0f}]")
    p = 1.0 if length == length_max else 0.0
    if 1.0 < length < length_max:  # bisection: p + p^2 + ... + p^n_max = length - 1
        lo, hi = 0.0, 1.0
        for _ in range(32):
            mid = 0.5 * (lo + hi)
            total = sum(mid ** (j + 1) for j in range(n_max))
            lo, hi = (mid, hi) if total < length - 1.0 else (lo, mid)
        p = 0.5 * (lo + hi)
    return [p ** (i + 1) for i in range(n_max)]


def conditional(rates: Sequence[float]) -> List[float]:
    """The probability of taking draft token ``i`` once the ones before it were taken."""
    out, prev = [], 1.0
    for r in rates:
        out.append(r / prev if prev > 0.0 else 0.0)
        prev = r
    return out


def request_rng(seed: int) -> random.Random:
    """A request's generator: seeded with its seed, or at random for the default seed."""
    return random.Random(random.getrandbits(32) if seed == DEFAULT_SEED else int(seed))


def parse_rates(text: str) -> List[float]:
    """``--spec-synth-rates P0,P1,...``: numbers, comma-separated."""
    try:
        return [float(x.strip()) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"invalid value: {text!r} (comma-separated numbers, e.g. 0.8,0.6,0.4)") from None


def parse_length(text: str) -> float:
    """``--spec-synth-len L``: a number (llama.cpp takes -1 for "not set" and refuses it)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"invalid value: {text!r} (a number, e.g. 2.5)") from None
    if value == -1.0:
        raise ValueError("invalid value: -1")
    return value
