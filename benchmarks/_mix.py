"""The realistic packed mix of the scale benchmarks (issue 25): seeded document lengths.

A 1M-token packed batch of a pretraining / SFT mix has about a thousand documents: log-normal
lengths with a median of ~460 tokens and a heavy tail, a few long documents of 5-6k tokens, and
a few 1-token documents (an empty turn, a separator). :func:`realistic_lens` draws such a mix:
``exp(N(ln 495, 1.5))`` tokens, rounded, ``>= 1``; a draw above :data:`LONG_MAX` is redrawn
uniformly in ``[LONG_MIN, LONG_MAX]`` (the 5-6k documents); :data:`ONES` 1-token documents are
put at random places; the last document is cut so the lengths sum to ``tokens`` exactly. At
``tokens = 2**20`` that is ~1000 documents (printed by the benchmarks that use it).
"""

from __future__ import annotations

import math

import numpy as np

MEDIAN = 495
SIGMA = 1.5
LONG_MIN, LONG_MAX = 5120, 6144
ONES = 4


def realistic_lens(tokens: int, seed: int = 0) -> list[int]:
    """Document lengths summing to ``tokens`` (a pure function of the arguments)."""
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    total = 0
    while total < tokens:
        n = max(1, round(float(np.exp(rng.normal(math.log(MEDIAN), SIGMA)))))
        if n > LONG_MAX:
            n = int(rng.integers(LONG_MIN, LONG_MAX + 1))
        n = min(n, tokens - total)
        lens.append(n)
        total += n
    for _ in range(min(ONES, max(len(lens) - 1, 0))):
        at = int(rng.integers(1, len(lens)))  # take one token of a longer document's end
        if lens[at - 1] > 1:
            lens[at - 1] -= 1
            lens.insert(at, 1)
    return lens


def describe(lens: list[int]) -> str:
    """One line: documents, median, longest, 1-token and >= 5k documents."""
    a = np.asarray(lens)
    return (
        f"{a.size} documents, {int(a.sum())} tokens, median {float(np.median(a)):.0f}, "
        f"max {int(a.max())}, >= {LONG_MIN}: {int((a >= LONG_MIN).sum())}, "
        f"1-token: {int((a == 1).sum())} (seeded log-normal mix, benchmarks/_mix.py)"
    )
