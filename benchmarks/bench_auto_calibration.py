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
checked against the cost facts' volume, exactly), then ``--rounds`` paired rounds time every
method (barrier, step, barrier; the slowest rank's time), the order rotated each round (A B C D,
B C D A, ...) so load drift and what ran just before hit every method alike. Every round's time is
kept (:attr:`cpshard.attention.calibration.Sample.rounds`); a method's time at a point is, by
``--stat``, :func:`~cpshard.attention.calibration.paired_estimate` (default: the differences
between methods from every round, the level from the quietest round), the median or the minimum.

Then :func:`cpshard.attention.calibration.fit_rates` fits the CPU+gloo rates (``--free``: compute
rate, link bandwidth, latency, overlap) by least squares of log time, each (point, method)
weighted by the spread of its rounds, on every point, and
:func:`~cpshard.attention.calibration.cross_validate` refits it once per point without that
point: the table's errors and picks are out-of-sample (``--table fit``: in-sample). A pick that
is not the measured best counts as a miss in the strict rate always, and in the within-noise rate
only when the picked method was slower than the best in enough paired rounds (a sign test at
``--alpha``); the table says per point whether the measured best is clear of the runner-up at
all. Ranks outnumbering the cores get ``cores / C`` of a core each
(:meth:`~cpshard.attention.cost.CostModel.scaled`). The fitted rates are printed as a
``CostModel(...)`` (:meth:`~cpshard.attention.cost.CostModel.cpu_gloo` holds this machine's): on
a GPU cluster run this benchmark's grid there (the same code, your backend) and pass the rates it
prints as ``attention_cost``.

Usage::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_auto_calibration.py
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_auto_calibration.py \\
        --seqs 16384 --cps 2 --rounds 3    # a quick look
    ... --save /tmp/c.pkl; ... --load /tmp/c.pkl --stat median --free compute_rate,latency
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
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
START = {
    "compute_rate": 2e10,
    "link_bandwidth": 1e9,
    "latency": 1e-3,
    "overlap": 0.5,
    "pass_rate": 1e8,
    "block_rate": 1e7,
    "gather_bandwidth": 1e9,
    "all_to_all_bandwidth": 1e9,
}


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


def grid_meta(mix: str, s: int, c: int) -> Any:
    """Rank 0's token meta of the grid's ``(mix, S, C)`` batch, without ranks: the placement
    :func:`~cpshard.make_cp_batch_and_ctx` makes of :func:`make_batch` with the mix's layout (the
    facts are global: any rank's meta gives them)."""
    from cpshard.layouts.balanced import plan_balanced
    from cpshard.layouts.closed_form import RoundRobinLayout
    from cpshard.layouts.packed import plan_packed
    from cpshard.sharding.meta import TokenMeta
    from cpshard.sharding.packed import pack_spec_of_batch

    batch, cpu = make_batch(mix, s), torch.device("cpu")
    if mix == "dense":
        pad = batch["attention_mask"] == 0
        placement = RoundRobinLayout().placement(c, pad.shape[0], pad.shape[1], pad, cpu)
    else:
        x = batch["input_ids"]
        spec = pack_spec_of_batch(batch, (x.shape[0], x.shape[1]))
        plan = plan_balanced(spec, c) if LAYOUT[mix] == "balanced" else plan_packed(spec, c)
        placement = plan.placement(cpu)
    return TokenMeta.of(placement, 0)


def _recomputed_facts(label: str, saved: dict[str, Any]) -> Any:
    """The plan facts of the point ``label`` (``"<mix> S=<k>k C=<C> ..."``) recomputed from
    :func:`grid_meta`, checked against the ``saved`` ones: a file written before a fact existed
    gets it (the grid's batches are deterministic)."""
    from cpshard.attention.cost import plan_facts

    mix, size, cp = label.split()[:3]
    facts = plan_facts(grid_meta(mix, int(size[2:-1]) * 1024, int(cp[2:])), blocks=True)
    for name in ("world", "local_len", "meta_rows"):
        if getattr(facts, name) != saved[name]:
            raise ValueError(f"{label}: recomputed {name} differs from the saved one")
    for name in ("pairs", "local_pairs", "recv_slots", "send_slots"):
        if [int(v) for v in getattr(facts, name)] != saved[name]:
            raise ValueError(f"{label}: recomputed {name} differ from the saved ones")
    return facts


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
        times: dict[str, list[float]] = {m: [] for m in methods}
        cpu: dict[str, list[float]] = {m: [] for m in methods}
        for r in range(rounds):  # paired rounds, the order rotated: A B C D, B C D A, ...
            gc.collect()
            for m in methods[r % len(methods) :] + methods[: r % len(methods)]:
                dist.barrier(group)
                t0, c0 = time.perf_counter(), time.process_time()
                step(m)
                dist.barrier(group)
                times[m].append(time.perf_counter() - t0)
                cpu[m].append(time.process_time() - c0)  # this process's CPU time, any thread
        out.append(
            {
                "times": times,
                "cpu": cpu,
                "sent": sent,
                "facts": plan_facts(meta, blocks=True),
                "rows": rows,
            }
        )
    return out


def save_samples(
    path: str, samples: list[Any], cpu_rounds: list[Any], load0: Any, load1: Any
) -> None:
    """The measured points as JSON: label, plan facts, call shape, share, rounds (wall seconds)
    and cpu_rounds (the ranks' CPU seconds)."""
    points = []
    for x, cpu in zip(samples, cpu_rounds, strict=True):
        f = x.facts
        facts = {"world": f.world, "local_len": f.local_len, "meta_rows": f.meta_rows}
        for name in ("pairs", "local_pairs", "recv_slots", "send_slots"):
            facts[name] = [int(v) for v in getattr(f, name)]
        pads = f.pad_pairs if f.pad_pairs is not None else np.zeros(f.world, dtype=np.int64)
        facts["pad_pairs"] = [int(v) for v in pads]
        if f.blocks is not None:
            b = f.blocks
            facts["blocks"] = {"own": [int(v) for v in b.own], "every": [int(v) for v in b.every],
                               "stream": b.stream, "exact": b.exact}  # fmt: skip
        rounds = {m: list(t) for m, t in x.rounds.items()}
        shape = dataclasses.asdict(x.shape)
        points.append(
            {"label": x.label, "facts": facts, "shape": shape, "share": x.share, "rounds": rounds,
             "cpu_rounds": {m: list(t) for m, t in cpu.items()}}
        )  # fmt: skip
    with open(path, "w") as fh:
        json.dump({"load_before": list(load0), "load_after": list(load1), "points": points}, fh)


def load_samples(path: str, clock: str = "wall") -> tuple[list[Any], Any, Any]:
    """The points of a :func:`save_samples` file (measured: the median until --stat says), by
    ``clock``: wall seconds, or CPU seconds (``share`` 1: a rank's CPU time is what its step
    takes on a core of its own). A file without ``pad_pairs`` or ``blocks`` (written before
    those facts) gets its facts recomputed (:func:`_recomputed_facts`)."""
    from cpshard.attention.calibration import Sample
    from cpshard.attention.cost import CallShape, KernelBlocks, PlanFacts

    with open(path) as fh:
        data = json.load(fh)
    out = []
    for pt in data["points"]:
        f = pt["facts"]
        arrays = {k: np.asarray(f[k], dtype=np.int64)
                  for k in ("pairs", "local_pairs", "recv_slots", "send_slots")}  # fmt: skip
        if "pad_pairs" in f and "blocks" in f:
            pads = np.asarray(f["pad_pairs"], dtype=np.int64)
            b = f["blocks"]
            blocks = KernelBlocks(np.asarray(b["own"], dtype=np.int64),
                                  np.asarray(b["every"], dtype=np.int64), float(b["stream"]),
                                  bool(b["exact"]))  # fmt: skip
            facts = PlanFacts(f["world"], f["local_len"], f["meta_rows"], **arrays,
                              pad_pairs=pads if pads.any() else None,
                              blocks=blocks)  # fmt: skip
        else:
            facts = _recomputed_facts(pt["label"], f)
        if clock == "cpu" and "cpu_rounds" not in pt:
            raise ValueError(f"{path}: no CPU times recorded (measured before --clock existed)")
        key, share = ("cpu_rounds", 1.0) if clock == "cpu" else ("rounds", pt["share"])
        rounds = {m: tuple(t) for m, t in pt[key].items()}
        measured = {m: float(np.median(t)) for m, t in rounds.items()}
        out.append(Sample(pt["label"], facts, CallShape(**pt["shape"]), measured, share,
                          rounds))  # fmt: skip
    return out, data["load_before"], data["load_after"]


def _stat(rounds: dict[str, Any], stat: str) -> dict[str, float]:
    """A point's time per method from its paired rounds."""
    from cpshard.attention.calibration import paired_estimate

    if stat == "paired":
        return paired_estimate(rounds)
    return {m: float(np.median(t)) if stat == "median" else min(t) for m, t in rounds.items()}


def main() -> None:
    from cpshard.attention.calibration import (
        FIT_RATES,
        Sample,
        calibration_table,
        cross_validate,
        fit_rates,
        format_table,
    )
    from cpshard.attention.cost import CallShape, CostModel
    from cpshard.launch import run_local_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="16384,32768,65536")
    p.add_argument("--cps", default="2,3,4")
    p.add_argument("--rounds", type=int, default=7, help="paired rounds per point")
    p.add_argument("--stat", choices=("paired", "median", "min"), default="paired",
                   help="per method: paired_estimate, median or min of rounds")  # fmt: skip
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: step time; cpu: slowest rank's CPU time (load-proof)")  # fmt: skip
    p.add_argument("--free", default=",".join(FIT_RATES), help="CostModel fields to fit")
    p.add_argument("--unweighted", action="store_true", help="every (point, method) weighs 1")
    p.add_argument("--alpha", type=float, default=0.05, help="sign test level of 'beyond noise'")
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--save", help="write the measured rounds here, JSON (refit with --load)")
    p.add_argument("--load", nargs="+",
                   help="fit and print the points of --save files, measure nothing")  # fmt: skip
    p.add_argument("--table", choices=("loo", "fit"), default="loo",
                   help="per-point table: held-out (leave one out) or in-sample")  # fmt: skip
    p.add_argument(
        "--share", choices=("cores", "one"), default="cores",
        help="cores: ranks beyond the cores get cores / C of one (CostModel.scaled); one: ignore",
    )  # fmt: skip
    args = p.parse_args()
    seqs = [int(x) for x in args.seqs.split(",")]
    cps = [int(x) for x in args.cps.split(",")]
    free = tuple(x for x in args.free.split(",") if x)
    cores = os.cpu_count() or 1
    load0 = os.getloadavg()
    print(
        f"machine: {platform.machine()} {cores} cores, Python {platform.python_version()}, torch "
        f"{torch.__version__}; head dim {args.head_dim}, fp32, "
        f"{'the loaded' if args.load else args.rounds} paired rounds ({args.stat} estimate, "
        f"{args.clock} clock)"
    )
    print(f"load average {'now' if args.load else 'before'}: "
          f"{' / '.join(f'{x:.2f}' for x in load0)}", flush=True)  # fmt: skip
    t_start = time.perf_counter()
    samples: list[Sample] = []
    other_clock: list[dict[str, tuple[float, ...]]] = []
    volume_ok = volume_all = 0
    if args.load:
        samples, loads = [], []
        for path in args.load:
            got, l0, l1 = load_samples(path, args.clock)
            samples += got
            loads.append(f"{path}: load {l0} -> {l1}")
        load0 = load1 = (float("nan"),) * 3
        cps = []
        samples = [  # the point estimate from the rounds, as --stat says
            dataclasses.replace(x, measured=_stat(dict(x.rounds), args.stat)) if x.rounds else x
            for x in samples
        ]  # fmt: skip
        print(f"loaded {len(samples)} points: " + "; ".join(loads))
    for c in cps:
        points = [pt for pt in grid(seqs, cps) if pt[1] == c]
        res = run_local_ranks(c, _rank, points, args.head_dim, args.rounds, timeout_s=3600)
        for i, (s, _, mix, hq, hkv) in enumerate(points):
            per_rank = [r[i] for r in res]
            facts, rows = per_rank[0]["facts"], per_rank[0]["rows"]
            shape = CallShape(rows, hq, hkv, args.head_dim, 4)
            methods = list(per_rank[0]["times"])
            rounds, cpu = (
                {  # the slowest rank's time, round by round
                    m: tuple(max(ts) for ts in zip(*(r[kind][m] for r in per_rank), strict=True))
                    for m in methods
                }
                for kind in ("times", "cpu")
            )
            label = f"{mix} S={s // 1024}k C={c} {hq}/{hkv}"
            share = min(1.0, cores / c) if args.share == "cores" else 1.0
            if args.clock == "cpu":
                rounds, cpu, share = cpu, rounds, 1.0
            samples.append(Sample(label, facts, shape, _stat(rounds, args.stat), share, rounds))
            other_clock.append(cpu)
            slot = 2 * hkv * args.head_dim * rows
            for r, got in enumerate(per_rank):  # fwd K/V fp32 sent, bwd dK/dV fp32 sent back
                want = (int(facts.send_slots[r]) + int(facts.recv_slots[r])) * slot * 4
                volume_ok += int(got["sent"] == want)
                volume_all += 1
        print(
            f"C={c}: {len(points)} points measured, {time.perf_counter() - t_start:.0f} s, "
            f"load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    if not args.load:
        load1 = os.getloadavg()
        print(
            f"selective bytes sent (CommRecorder) == cost facts' volume: {volume_ok} of "
            f"{volume_all} (point, rank) pairs"
        )
        print(f"load average after: {' / '.join(f'{x:.2f}' for x in load1)}; "
              f"measuring took {time.perf_counter() - t_start:.0f} s")  # fmt: skip
    if args.save:
        wall, cpus = samples, other_clock  # the file keeps wall rounds as rounds
        if args.clock == "cpu":
            wall = [
                dataclasses.replace(x, rounds=o, share=min(1.0, cores / x.facts.world))
                for x, o in zip(samples, other_clock, strict=True)
            ]
            cpus = [dict(x.rounds) for x in samples]
        save_samples(args.save, wall, cpus, load0, load1)
    if args.share == "one":
        samples = [dataclasses.replace(x, share=1.0) for x in samples]
    weighted = not args.unweighted
    n_rounds = "/".join(
        sorted({str(len(next(iter(x.rounds.values())))) for x in samples if x.rounds})
    )
    t_fit = time.perf_counter()
    model = fit_rates(samples, CostModel(**START), free, weighted=weighted)  # type: ignore[arg-type]
    fields = ", ".join(f"{f}={getattr(model, f):.4g}" for f in free)
    print(
        f"\nfitted on all {len(samples)} points ({'weighted' if weighted else 'unweighted'} least "
        f"squares of log time): CostModel({fields})  [one rank per core]"
    )
    fit_rows, fit_points, fit_sum = calibration_table(samples, model, alpha=args.alpha)
    loo_rows, loo_points, loo_sum = cross_validate(
        samples, model, free, weighted=weighted, alpha=args.alpha
    )
    print(f"fit + leave-one-point-out refits: {time.perf_counter() - t_fit:.0f} s\n")
    if args.table == "loo":
        print("Held-out table (each point predicted by the rates fitted on the others):\n")
        print(format_table(loo_rows, loo_points, loo_sum))
    else:
        print("In-sample table (the rates fitted on every point):\n")
        print(format_table(fit_rows, fit_points, fit_sum))
    _, _, d = calibration_table(samples, CostModel(), alpha=args.alpha)
    _, _, g = calibration_table(samples, CostModel.cpu_gloo(), alpha=args.alpha)
    print("\n| summary | within +-15% | rms log err | picks best (strict) | best or within noise "
          "| within 5% of best |\n|---|---|---|---|---|---|")  # fmt: skip
    for name, x in (
        ("held-out (leave one point out)", loo_sum),
        ("in-sample (fit on all)", fit_sum),
        ("CostModel.cpu_gloo() as committed", g),
        ("default CostModel() (GPU rates)", d),
    ):
        print(
            f"| {name} | {x.within:.0%} of {x.rows} | {x.log_rms:.3f} | {x.picked_best:.0%} "
            f"| {x.picked_within_noise:.0%} | {x.picked_near:.0%} |"
        )
    print(
        f"\n{fit_sum.points} points; the measured best beats the runner-up beyond the noise "
        f"(sign test, {n_rounds} paired rounds, alpha {args.alpha}) at {fit_sum.clear:.0%} of "
        f"them; rounds' IQR/median: median {fit_sum.spread:.1%}, max "
        f"{max(r.spread for r in fit_rows):.1%}."
    )


if __name__ == "__main__":
    main()
