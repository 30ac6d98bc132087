"""Calibrate the cost model of ``attention="auto"``: measured vs predicted step time per method.

On local gloo ranks (1 thread each), one attention layer's forward + backward (``cp_sdpa``, fp32)
is timed per method over a grid:

* ``S`` in ``--seqs`` (16k, 32k, 64k tokens), CP size in ``--cps`` (2, 3, 4);
* batches: ``lognormal`` (packed log-normal documents, median ~460, capped at 4096; the
  ``balanced`` layout, the dispatcher's default for packed batches), ``long`` (S / 16k documents
  of 5-6k tokens among log-normal ones, median ~245; TE's ``packed`` layout: nearly every key is
  needed everywhere), ``dense`` (rows of 2048 tokens, real length uniform in [1024, 2048], the
  rest padding, S / 2048 rows; ``round_robin``, the dispatcher's default for dense batches);
* GQA 8/8, 8/2, 8/1 (``Hq/Hkv``), rotated over the grid (a Latin square: every (S, batch) pair
  and every (C, batch) pair sees all three), head dim ``--head-dim``;
* methods: all_gather, ring, selective, and ulysses where the heads divide by C.

Each CP size runs in one launch of ``C`` ranks; per point every method runs once to warm up (its
selective run recorded by :class:`cpshard._comm.CommRecorder`: the bytes each rank sends,
checked against the cost facts' volume, exactly), then ``--rounds`` rounds time every method in
turn (barrier, step, barrier; the minimum over rounds counts, the slowest rank's), so a shared
machine's load disturbs all methods alike.

Then :func:`cpshard.attention.calibration.fit_rates` fits the CPU+gloo rates (compute rate,
link bandwidth, latency, overlap) on the points with ``S`` in ``--fit-seqs`` and the table of
:func:`~cpshard.attention.calibration.calibration_table` compares predicted and measured at every
point (fitted and held-out separately). Ranks outnumbering the cores get ``cores / C`` of a core
each (:meth:`~cpshard.attention.cost.CostModel.scaled`). The fitted rates are printed as a
``CostModel(...)``: on a GPU cluster run this benchmark's grid there (the same code, your
backend) and pass the rates it prints as ``attention_cost``.

Usage::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_auto_calibration.py
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_auto_calibration.py \\
        --seqs 16384 --cps 2 --rounds 1    # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pickle
import platform
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_packed_attention import doc_lengths

MIXES = ("lognormal", "long", "dense")
LAYOUT = {"lognormal": "balanced", "long": "packed", "dense": "round_robin"}
GQAS = ((8, 8), (8, 2), (8, 1))
ROW = 2048  # dense rows
START = {"compute_rate": 2e10, "link_bandwidth": 1e9, "latency": 1e-3, "overlap": 0.5}


def lognormal_lens(tokens: int, seed: int = 0) -> list[int]:
    """Packed document lengths: ``exp(N(ln 460, 1.0))`` capped at 4096, summing to ``tokens``."""
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(int(min(4096, max(1, round(float(np.exp(rng.normal(math.log(460), 1.0))))))))
    lens[-1] -= sum(lens) - tokens
    return [n for n in lens if n > 0]


def make_batch(mix: str, s: int, seed: int = 0) -> dict[str, Any]:
    """The grid's batch of ``s`` tokens (dense: ``s / ROW`` padded rows)."""
    if mix == "dense":
        rows = s // ROW
        real = np.random.default_rng(seed).integers(ROW // 2, ROW + 1, size=rows)
        mask = (torch.arange(ROW)[None] < torch.as_tensor(real)[:, None]).long()
        return {"input_ids": torch.ones(rows, ROW, dtype=torch.long), "attention_mask": mask}
    lens = lognormal_lens(s, seed) if mix == "lognormal" else doc_lengths(s, seed)
    return {"input_ids": torch.ones(1, s, dtype=torch.long), "seq_lens": [lens]}


def grid(seqs: list[int], cps: list[int]) -> list[tuple[int, int, str, int, int]]:
    """``(S, C, batch, Hq, Hkv)`` points, GQA rotated as a Latin square."""
    out = []
    for i, s in enumerate(seqs):
        for j, c in enumerate(cps):
            for k, mix in enumerate(MIXES):
                hq, hkv = GQAS[(i + j + k) % len(GQAS)]
                out.append((s, c, mix, hq, hkv))
    return out


def methods_for(c: int, hq: int, hkv: int) -> list[str]:
    out = ["all_gather", "ring", "selective"]
    if hq % c == 0 and hkv % c == 0:
        out.append("ulysses")
    return out


def _rank(mesh: Any, points: list[tuple[int, int, str, int, int]], dim: int, rounds: int) -> Any:
    """On every rank: per point, the fastest step per method, the selective bytes sent, facts."""
    import torch.distributed as dist

    from cpshard import make_cp_batch_and_ctx
    from cpshard._comm import CommRecorder, cp_group
    from cpshard.attention import cp_sdpa
    from cpshard.attention.cost import plan_facts

    group = cp_group(mesh)
    out = []
    for s, c, mix, hq, hkv in points:
        _, _, sharder = make_cp_batch_and_ctx(mesh, make_batch(mix, s), layout=LAYOUT[mix])
        meta = sharder.token_meta
        assert meta is not None
        b, n = meta.positions.shape[0], meta.local_len
        rows = b if mix == "dense" else 1
        g = torch.Generator().manual_seed(dist.get_rank())
        q = torch.randn(rows, hq, n, dim, generator=g).requires_grad_()
        k = torch.randn(rows, hkv, n, dim, generator=g).requires_grad_()
        v = torch.randn(rows, hkv, n, dim, generator=g).requires_grad_()
        go = torch.randn(rows, hq, n, dim, generator=g)
        methods = methods_for(c, hq, hkv)

        def step(m: str, qkv: Any = (q, k, v, go), meta: Any = meta) -> None:
            cp_sdpa(*qkv[:3], group=group, meta=meta, method=m).backward(qkv[3])

        sent = 0
        for m in methods:  # warm-up: plans built, allocator grown
            if m == "selective":
                with CommRecorder() as rec:
                    step(m)
                sent = sum(nb for kind, nb in rec.events if kind == "all_to_all")
            else:
                step(m)
        best = dict.fromkeys(methods, float("inf"))
        for _ in range(rounds):
            for m in methods:
                dist.barrier(group)
                t0 = time.perf_counter()
                step(m)
                dist.barrier(group)
                best[m] = min(best[m], time.perf_counter() - t0)
        out.append({"best": best, "sent": sent, "facts": plan_facts(meta), "rows": rows})
    return out


def main() -> None:
    from cpshard.attention.calibration import Sample, calibration_table, fit_rates, format_table
    from cpshard.attention.cost import CallShape, CostModel
    from cpshard.launch import run_local_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="16384,32768,65536")
    p.add_argument("--cps", default="2,3,4")
    p.add_argument("--fit-seqs", default="32768", help="S of the points the rates are fitted on")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--save", help="pickle the measured samples here (refit with --load)")
    p.add_argument("--load", help="fit and print the samples of a --save file, measure nothing")
    p.add_argument(
        "--share", choices=("cores", "one"), default="cores",
        help="cores: ranks beyond the cores get cores / C of one (CostModel.scaled); one: ignore",
    )  # fmt: skip
    args = p.parse_args()
    seqs = [int(x) for x in args.seqs.split(",")]
    cps = [int(x) for x in args.cps.split(",")]
    fit_seqs = {int(x) for x in args.fit_seqs.split(",")}
    cores = os.cpu_count() or 1
    load0 = os.getloadavg()
    print(
        f"machine: {platform.machine()} {cores} cores, Python {platform.python_version()}, torch "
        f"{torch.__version__}; head dim {args.head_dim}, fp32, {args.rounds} rounds (min counts)"
    )
    print(f"load average before: {' / '.join(f'{x:.2f}' for x in load0)}", flush=True)
    t_start = time.perf_counter()
    samples: list[Sample] = []
    fitted_on: set[str] = set()
    volume_ok = volume_all = 0
    if args.load:
        with open(args.load, "rb") as fh:
            samples, load0, load1 = pickle.load(fh)
        cps = []
        fitted_on = {x.label for x in samples if int(x.label.split("S=")[1].split("k")[0]) * 1024
                     in fit_seqs}  # fmt: skip
        print(f"loaded {len(samples)} samples measured at load {load0} -> {load1}")
    for c in cps:
        points = [pt for pt in grid(seqs, cps) if pt[1] == c]
        res = run_local_ranks(c, _rank, points, args.head_dim, args.rounds, timeout_s=3600)
        for i, (s, _, mix, hq, hkv) in enumerate(points):
            per_rank = [r[i] for r in res]
            facts, rows = per_rank[0]["facts"], per_rank[0]["rows"]
            shape = CallShape(rows, hq, hkv, args.head_dim, 4)
            measured = {m: max(r["best"][m] for r in per_rank) for m in per_rank[0]["best"]}
            label = f"{mix} S={s // 1024}k C={c} {hq}/{hkv}"
            share = min(1.0, cores / c) if args.share == "cores" else 1.0
            samples.append(Sample(label, facts, shape, measured, share))
            if s in fit_seqs:
                fitted_on.add(label)
            slot = 2 * hkv * args.head_dim * rows
            for r, got in enumerate(per_rank):  # fwd K/V fp32 sent, bwd dK/dV fp32 sent back
                want = (int(facts.send_slots[r]) + int(facts.recv_slots[r])) * slot * 4
                volume_ok += int(got["sent"] == want)
                volume_all += 1
        print(
            f"C={c}: {len(points)} points measured, {time.perf_counter() - t_start:.0f} s",
            flush=True,
        )
    if not args.load:
        load1 = os.getloadavg()
    if args.save:
        with open(args.save, "wb") as fh:
            pickle.dump((samples, load0, load1), fh)
    if args.load and args.share == "one":
        samples = [dataclasses.replace(x, share=1.0) for x in samples]
    fit = [s for s in samples if s.label in fitted_on] or samples
    model = fit_rates(fit, CostModel(**START))  # type: ignore[arg-type]
    print(f"\nload average after: {' / '.join(f'{x:.2f}' for x in load1)}; "
          f"measuring took {time.perf_counter() - t_start:.0f} s")  # fmt: skip
    print(
        f"selective bytes sent (CommRecorder) == cost facts' volume: {volume_ok} of "
        f"{volume_all} (point, rank) pairs"
    )
    print(
        f"fitted on {len(fit)} points (S in {sorted(fit_seqs)}): CostModel(compute_rate="
        f"{model.compute_rate:.4g}, link_bandwidth={model.link_bandwidth:.4g}, "
        f"latency={model.latency:.4g}, overlap={model.overlap:.3f})  [one rank per core]\n"
    )
    rows_, points_, summary = calibration_table(samples, model)
    print(format_table(rows_, points_, summary))
    held = [s for s in samples if s.label not in fitted_on]
    if held and len(held) < len(samples):
        _, _, h = calibration_table(held, model)
        print(
            f"Held-out points only ({h.points}): within +-15% {h.within:.0%} of {h.rows} rows; "
            f"picks the best {h.picked_best:.0%}, within 5% of it {h.picked_near:.0%}."
        )
    default = CostModel()
    _, _, d = calibration_table(samples, default)
    print(
        f"Default CostModel() (GPU rates) on the same points: picks the best {d.picked_best:.0%}, "
        f"within 5% {d.picked_near:.0%}."
    )


if __name__ == "__main__":
    main()
