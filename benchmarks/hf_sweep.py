"""Sweep every causal LM of the installed transformers under CP: counts exact / refused / wrong.

Each architecture is built tiny (``tests/_hf_sweep.py``), and one fp64 training step runs at
cp=2 ring (round_robin), cp=3 all_gather (round_robin) and cp=2 packed ``balanced`` against one
process running the model's own attention. An architecture's verdict is its worst case
(crash > wrong > refused > exact); ``skip`` = it cannot be built tiny or its own reference fails.

Run (2 vCPU shared, loaded: about 20-40 min):

    PYTHONPATH=src:tests OMP_NUM_THREADS=1 nice python benchmarks/hf_sweep.py [--archs a,b]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from _hf_sweep import CASES, Outcome, causal_lm_archs, sweep_case
from cpshard.tools.launch import LocalRanks, RankFailure

_RANK = {"exact": 0, "skip": 0, "refused": 1, "wrong": 2, "crash": 3}


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def _run(pool: LocalRanks, arch: str, method: str, layout: str) -> Outcome:
    try:
        outs = pool.run(sweep_case, arch, method, layout, timeout_s=300)
    except RankFailure as e:
        return Outcome("crash", f"rank failure: {str(e)[:300]}")
    kinds = {o.kind for o in outs}
    if len(kinds) > 1:
        return Outcome("crash", f"ranks disagree: {[o.kind for o in outs]}")
    return outs[0]


def main() -> None:
    """Print one line per architecture and the counts."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--archs", default="", help="comma-separated model types (default all)")
    args = parser.parse_args()
    _quiet()
    archs = [a for a in args.archs.split(",") if a] or causal_lm_archs()
    pools: dict[int, LocalRanks] = {}
    counts: Counter[str] = Counter()
    start = time.perf_counter()
    for arch in archs:
        verdict = Outcome("exact")
        details = []
        for name, world, method, layout in CASES:
            pool = pools.get(world)
            if pool is None or not pool.alive():
                pool = pools[world] = LocalRanks(world)
            out = _run(pool, arch, method, layout)
            if out.kind == "crash":  # its mesh may be out of step: the next case gets fresh ranks
                pool.close()
            details.append(f"{name}={out.kind}")
            if out.kind == "skip":
                verdict = out
                break
            if _RANK[out.kind] > _RANK[verdict.kind]:
                verdict = out
        counts[verdict.kind] += 1
        first = verdict.detail.splitlines()[0][:160] if verdict.detail else ""
        print(f"{arch:28s} {verdict.kind:8s} {' '.join(details)}  {first}", flush=True)
    for pool in pools.values():
        pool.close()
    total = sum(counts.values())
    print(
        f"\n{total} architectures: "
        + ", ".join(f"{counts[k]} {k}" for k in ("exact", "refused", "wrong", "crash", "skip"))
        + f"  ({time.perf_counter() - start:.0f} s)"
    )


if __name__ == "__main__":
    _quiet()
    main()
