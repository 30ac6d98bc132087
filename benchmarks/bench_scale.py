"""Issue 25: host planning at 1M tokens and ``prepare_cp_forward`` at ``[8, 32768]``, each figure
printed beside its goal and beside a bare ``index_select`` timed in the same run.

Part ``plans`` (host-simulated ranks, one process): the realistic mix of :mod:`_mix` (~1000
log-normal documents in one packed row of ``--tokens`` tokens) under every packed layout
(``contiguous``, ``round_robin``, TE's ``packed``, ``balanced``), and ``dense padded`` rows
(``[--rows, tokens / rows]``, one sequence per row, real length uniform in ``[S/4, S]``,
``attention_mask`` padding, round_robin). For each CP size and ranks ``0, C/2, C-1`` (the slowest
counts), on a fresh token meta each time (built outside the timer, as the sharder builds it):

* ``selective``: the rank's :class:`SelectivePlan` (exchange and kernel plans), and its kernel
  calls per layer and pass (the local and the remote plan's tasks);
* ``auto``: everything ``attention="auto"`` does for a batch: the cost facts of every rank (the
  choice must be identical on every rank without a collective), the choice, and the plan of the
  chosen method;

process CPU time, fastest of ``--repeat``; goal <= 0.1 s each. ``bare`` is one ``index_select``
of the batch's int64 ids (``[1, tokens]``, or the dense ``[rows, tokens / rows]``) by the
layout's whole rank map (a permutation), timed in the same run: the ratio ``plan / bare`` is the
figure a loaded machine does not move much.

Part ``prepare`` (``--ranks`` gloo ranks, 1 thread each): ``prepare_cp_forward`` of a tiny
decoder (``--model llama32``: a 32-layer HF Llama module tree, the per-module checks at a real
model's size) at ``[--batch, --seq]`` (``input_ids`` + ``labels`` int64; ``dense padded``: real
lengths uniform in ``[S/4, S]`` with ``attention_mask``, round_robin; ``packed``: log-normal
documents via ``seq_lens``, balanced), ``attention="auto"``, the batch check on; rank 0's
median process CPU time per call, and per stage (benchmark-side timers around the dispatcher's
steps): the fingerprint (content hash of the batch), the step header's exchange, the sharding
(the sharder's ``shard``: layout, token meta, local tensors and their record), the auto cost
facts and the chosen method's plan; and the model's checks: the weights fingerprint (inside the
header exchange) and the token-mixer detection (in the prepare's validation). Goal <= 5 ms;
``bare`` = one ``index_select`` per batch tensor with precomputed indices. The *floor* of a
checked prepare is what no implementation can skip: ``bare`` (the local tensors), the batch's
content hash (:func:`~cpshard.sharding.consistency.batch_fingerprint`, every value read once)
and one step-header all-gather with both ranks already there, each timed in the same run. The
*per-call cost* is the same prepare of a ``[1, 256]`` batch of the same kind (the work that does
not scale with the tokens: Python, small host arrays, the model checks, the collectives).

Part ``remote`` (one process): rank ``C/2``'s remote attention pass under TE's ``packed`` layout
of the mix (selective's queries against the keys it receives, forward + backward, fp32), its
received keys read in arrival order and in stream order: kernel calls, pairs computed / needed
and CPU time, fastest of ``--repeat``.

Part ``host`` (one process, no second rank): rank 0's cost facts, choice and plan of the dense
padded batch, the batch fingerprint of its three tensors, and the packed batch's shard (rank 0
of ``--ranks``: the balanced layout plan, the local tensors and the token meta), fastest of 15
each: the parts of the prepare this work changed, without a competing rank's noise.

Usage::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_scale.py --part plans
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_scale.py --part prepare
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_scale.py --part host
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _mix import describe, realistic_lens
from _timing import fastest_cpu_wall

PLAN_GOAL_S = 0.1
PREPARE_GOAL_MS = 5.0


def _dense_meta(world: int, rank: int, rows: int, seq: int) -> Any:
    """Rank ``rank``'s token meta of ``[rows, seq]`` padded rows (round_robin)."""
    from cpshard.layouts.closed_form import RoundRobinLayout
    from cpshard.sharding.meta import TokenMeta

    rng = np.random.default_rng(0)
    real = rng.integers(seq // 4, seq + 1, size=rows)
    pad = torch.arange(seq)[None] >= torch.from_numpy(real)[:, None]
    placement = RoundRobinLayout().placement(world, rows, seq, pad, torch.device("cpu"))
    return TokenMeta.of(placement, rank)


def _plans_part(tokens: int, cps: list[int], rows: int, repeat: int) -> None:
    from cpshard.attention.auto import choose_for_batch
    from cpshard.attention.methods import method_named
    from cpshard.attention.plan import AttentionPlan
    from cpshard.attention.selective_plan import selective_plan
    from cpshard.layouts.documents import PackSpec
    from cpshard.tools.balance import all_plans
    from cpshard.tools.plan_cost import plan_meta

    cpu = torch.device("cpu")
    lens = realistic_lens(tokens)
    print(f"mix: {describe(lens)}; dense padded: [{rows}, {tokens // rows}]")
    spec = PackSpec.from_seq_lens([lens], tokens)
    ids = torch.from_numpy(np.random.default_rng(0).integers(1, 32000, size=(1, tokens)))
    print(
        "| layout | C | selective CPU s (x goal, x bare) | selective kernel calls | auto CPU s "
        "(x goal, x bare) | auto chose | bare index_select CPU ms | goal |"
    )
    print("|---|---|---|---|---|---|---|---|")

    def auto(meta: Any) -> str:
        best = choose_for_batch(meta, None)
        method_named(best).plans(AttentionPlan(meta), True, None, cpu)
        return best

    def selective(meta: Any) -> int:
        plan = selective_plan(meta, True, None, cpu)
        return sum(len(tasks) for p in (plan.local, plan.remote) for _, tasks in p.groups)

    for c in cps:
        makers: list[tuple[str, Callable[[int], Any], torch.Tensor]] = []
        for plan in all_plans(spec, c, include_torch=False):
            makers.append((plan.layout, functools.partial(plan_meta, plan), plan.rank_map))
        dense = functools.partial(_dense_meta, c, rows=rows, seq=tokens // rows)
        makers.append(("dense padded", lambda r, d=dense: d(r), dense(0).positions[0]))
        for name, make, rank_map in makers:
            order = rank_map.reshape(-1)  # the padded stream; dense padded: one row's
            rows_ids = ids.reshape(rows, -1) if name == "dense padded" else ids
            order = order.clamp(max=rows_ids.shape[1] - 1)
            t_bare = fastest_cpu_wall(
                lambda o=order, x=rows_ids: (x, o), lambda xo: xo[0].index_select(1, xo[1]), 5
            )[0]
            t_sel = t_auto = 0.0
            chosen, calls = set(), 0
            for r in sorted({0, c // 2, c - 1}):
                fresh = functools.partial(make, r)
                got = fastest_cpu_wall(fresh, selective, repeat)
                t_sel, calls = max(t_sel, got[0]), max(calls, got[2])
                got = fastest_cpu_wall(fresh, auto, repeat)
                t_auto = max(t_auto, got[0])
                chosen.add(got[2])
            print(
                f"| {name} | {c} | {t_sel:.3f} ({t_sel / PLAN_GOAL_S:.2f}, {t_sel / t_bare:.0f}x) "
                f"| {calls} | {t_auto:.3f} ({t_auto / PLAN_GOAL_S:.2f}, {t_auto / t_bare:.0f}x) "
                f"| {'/'.join(sorted(chosen))} | {t_bare * 1e3:.2f} | <= {PLAN_GOAL_S} s |",
                flush=True,
            )


_STAGES = {
    "fingerprint": ("cpshard.dispatch", "dispatch_fingerprint"),
    "header exchange": ("cpshard.dispatch", "begin_prepare"),
    "sharding": ("cpshard.dispatch", "_shard"),
    "cost facts + choice": ("cpshard.dispatch", "choose_for_batch"),
    "cp attention (facts + plan)": ("cpshard.dispatch", "_with_cp_attention"),
    "model weights fingerprint (in the header exchange)": (
        "cpshard.guards.step",
        "model_fingerprint",
    ),
    "token-mixer detection": ("cpshard.mixers.policy", "find_token_mixers"),
}


def _model(name: str) -> torch.nn.Module:
    """The prepared model: ``tiny`` (a 1-layer decoder) or ``llama32`` (an HF Llama with a
    real 32-layer module tree, hidden size 64: the per-module checks cost what they cost on a
    7B model's tree)."""
    if name == "tiny":
        from cpshard.models.decoder import TinyDecoder, TinyDecoderConfig

        return TinyDecoder(TinyDecoderConfig(
            vocab_size=32000, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
            intermediate_size=32,
        ))  # fmt: skip
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
        num_attention_heads=4, num_key_value_heads=2,
    ))  # fmt: skip


def _prepare_rank(mesh: Any, b: int, s: int, repeat: int, model_name: str) -> list[dict[str, Any]]:
    """Rank-side: time prepare_cp_forward and its stages (timers installed in this forked
    rank process only, and removed after)."""
    import importlib

    from bench_shard_batch import _batches

    import cpshard
    from cpshard import _comm
    from cpshard.guards.step import HEADER_SIZE, PAYLOAD_SIZE
    from cpshard.sharding.consistency import batch_fingerprint

    torch.set_num_threads(1)
    header = torch.zeros(HEADER_SIZE + PAYLOAD_SIZE, dtype=torch.long)
    spent: dict[str, float] = {}
    saved = []
    for stage, (mod_name, attr) in _STAGES.items():
        mod = importlib.import_module(mod_name)
        real = getattr(mod, attr)
        saved.append((mod, attr, real))

        def timed(*a: Any, _f: Any = real, _k: str = stage, **k: Any) -> Any:
            t0 = time.process_time()
            try:
                return _f(*a, **k)
            finally:
                spent[_k] = spent.get(_k, 0.0) + time.process_time() - t0

        setattr(mod, attr, timed)
    model = _model(model_name)
    rows = []
    small = _batches(1, 256)
    try:
        for name, batch in _batches(b, s).items():
            layout = "balanced" if name == "packed" else "round_robin"
            _, _, sharder = cpshard.prepare_cp_forward(model, mesh, batch, layout=layout)
            local = sharder.rank_map[mesh.get_local_rank()]  # type: ignore[index]
            flat = {k: v.reshape(1, -1) if name == "packed" else v for k, v in batch.items()
                    if isinstance(v, torch.Tensor)}  # fmt: skip
            total, bare, hashed, gathered = [], [], [], []
            spent.clear()
            for _ in range(repeat):
                torch.distributed.barrier()
                t0 = time.process_time()
                cpshard.prepare_cp_forward(model, mesh, batch, layout=layout)
                total.append(time.process_time() - t0)
                t0 = time.process_time()
                for v in flat.values():
                    v.index_select(1, local.clamp(max=v.shape[1] - 1))
                bare.append(time.process_time() - t0)
                t0 = time.process_time()
                batch_fingerprint(batch, layout=layout, attention="auto", padding_token_id=0)
                hashed.append(time.process_time() - t0)
                torch.distributed.barrier()  # both ranks there: the gather without a wait
                t0 = time.process_time()
                _comm.all_gather_fixed(header, mesh.get_group())
                gathered.append(time.process_time() - t0)
            stages = {k: v / repeat * 1e3 for k, v in spent.items()}
            stages["plan of the chosen method"] = (
                stages.pop("cp attention (facts + plan)") - stages["cost facts + choice"]
            )
            fixed = []  # the same prepare of a [1, 256] batch of this kind: the per-call cost
            for _ in range(repeat):
                torch.distributed.barrier()
                t0 = time.process_time()
                cpshard.prepare_cp_forward(model, mesh, small[name], layout=layout)
                fixed.append(time.process_time() - t0)
            rows.append({
                "batch": name, "total": statistics.median(total) * 1e3,
                "bare": statistics.median(bare) * 1e3, "stages": stages,
                "hash": statistics.median(hashed) * 1e3,
                "gather": statistics.median(gathered) * 1e3,
                "fixed": statistics.median(fixed) * 1e3,
            })  # fmt: skip
    finally:
        for mod, attr, real in saved:
            setattr(mod, attr, real)
    return rows


def _prepare_part(b: int, s: int, ranks: int, repeat: int, model_name: str) -> None:
    from cpshard.launch import run_local_ranks

    print(f"prepare_cp_forward at [{b}, {s}], cp={ranks}, attention='auto', check on, model "
          f"{model_name}; rank 0")  # fmt: skip
    for r in run_local_ranks(ranks, _prepare_rank, b, s, repeat, model_name)[0]:
        t, bare = r["total"], r["bare"]
        print(f"\n{r['batch']}: prepare {t:.2f} ms CPU (goal <= {PREPARE_GOAL_MS} ms: "
              f"{t / PREPARE_GOAL_MS:.2f}x the goal), bare index_select {bare:.2f} ms "
              f"(prepare / bare {t / bare:.1f}x)")  # fmt: skip
        floor = bare + r["hash"] + r["gather"]
        print(f"floor of a checked prepare: bare index_select {bare:.2f} + batch content hash "
              f"{r['hash']:.2f} + one header all-gather {r['gather']:.2f} = {floor:.2f} ms "
              f"(prepare / floor {t / floor:.2f}x)")  # fmt: skip
        print(f"per-call cost (the same prepare of a [1, 256] batch): {r['fixed']:.2f} ms; what "
              f"scales with the batch: {t - r['fixed']:.2f} ms")  # fmt: skip
        print("| stage | CPU ms per prepare (mean) | / bare index_select |")
        print("|---|---|---|")
        for k, v in r["stages"].items():
            print(f"| {k} | {v:.2f} | {v / bare:.1f}x |")


def _host_part(b: int, s: int, ranks: int, repeat: int) -> None:
    """One process, no second rank: rank 0's host work of the prepare's attention and the batch
    fingerprint of the dense padded batch, each fastest of ``repeat`` on a fresh meta."""
    from bench_shard_batch import _batches

    from cpshard.attention.auto import choose_for_batch
    from cpshard.attention.cost import plan_facts
    from cpshard.attention.methods import method_named
    from cpshard.attention.plan import AttentionPlan
    from cpshard.sharding.consistency import batch_fingerprint
    from cpshard.sharding.packed import shard_batch_packed

    cpu = torch.device("cpu")
    best: dict[str, float] = {}
    for _ in range(repeat):
        meta = _dense_meta(ranks, 0, b, s)
        t0 = time.process_time()
        plan_facts(meta)
        t1 = time.process_time()
        method = choose_for_batch(meta, None)
        t2 = time.process_time()
        method_named(method).plans(AttentionPlan(meta), True, None, cpu)
        t3 = time.process_time()
        for k, v in (("cost facts", t1 - t0), ("choice", t2 - t1), (f"plan ({method})", t3 - t2),
                     ("facts + choice + plan", t3 - t0)):  # fmt: skip
            best[k] = min(best.get(k, float("inf")), v)
    batch = {k: v for k, v in _batches(b, s)["dense padded"].items()}
    fp = fastest_cpu_wall(
        lambda: batch,
        lambda x: batch_fingerprint(x, layout="auto", attention="auto", padding_token_id=0),
        repeat,
    )[0]
    ids = batch["input_ids"]
    local = _dense_meta(ranks, 0, b, s).positions[0, : s // ranks]
    bare = fastest_cpu_wall(lambda: local, lambda i: ids.index_select(1, i), repeat)[0]
    packed = _batches(b, s)["packed"]
    # rank 0 of the CP mesh, as the shard asks it (no process group: its host work alone)
    rank0: Any = types.SimpleNamespace(get_local_rank=lambda: 0, size=lambda: ranks)
    shard = fastest_cpu_wall(
        lambda: packed, lambda x: shard_batch_packed(rank0, None, x, layout="balanced"), repeat
    )[0]
    print(f"one process, dense padded [{b}, {s}], cp={ranks} rank 0, fastest of {repeat}")
    print("| host work | CPU ms | / bare index_select |")
    print("|---|---|---|")
    for k, v in (*best.items(), ("batch fingerprint (ids, labels, mask)", fp),
                 ("bare index_select of input_ids", bare),
                 ("packed batch's shard (balanced, layout plan included)", shard)):  # fmt: skip
        print(f"| {k} | {v * 1e3:.2f} | {v / bare:.1f}x |")


def _remote_part(tokens: int, cps: list[int], repeat: int) -> None:
    """One process: rank ``C/2``'s remote attention pass (selective's queries against the keys it
    receives, forward + backward, fp32, 2 query heads / 1 key head, head dim 64) under TE's
    ``packed`` layout of the 1M-token mix, its received keys read in arrival order (the rule off)
    and in stream order (the rule on): kernel calls, pairs computed / needed, CPU seconds."""
    import cpshard.attention.selective_plan as sp
    from cpshard.attention.blockwise import attend, attend_backward_into
    from cpshard.layouts.documents import PackSpec
    from cpshard.tools.balance import all_plans
    from cpshard.tools.plan_cost import plan_meta

    cpu = torch.device("cpu")
    spec = PackSpec.from_seq_lens([realistic_lens(tokens)], tokens)
    print("| C | received keys read in | kernel calls | pairs computed / needed | forward + "
          "backward CPU s |")  # fmt: skip
    print("|---|---|---|---|---|")
    for c in cps:
        (plan,) = [p for p in all_plans(spec, c, include_torch=False) if p.layout == "packed"]
        for label, short in (("arrival order", 0), ("stream order", sp.SHORT_RUNS)):
            rule = sp.SHORT_RUNS
            sp.SHORT_RUNS = short
            try:
                sel = sp.selective_plan(plan_meta(plan, c // 2), True, None, cpu)
            finally:
                sp.SHORT_RUNS = rule
            remote = sel.remote
            g = torch.Generator().manual_seed(0)
            n, nk = plan.rank_map.shape[1], sel.recv_slots.size
            q = torch.randn(1, 2, n, 64, generator=g)
            k, v = (torch.randn(1, 1, nk, 64, generator=g) for _ in range(2))

            def step(_: Any, q: Any = q, k: Any = k, v: Any = v, remote: Any = remote) -> None:
                out, lse = attend(q, k, v, remote, scale=0.125)
                dq = torch.zeros_like(out)
                dk, dv = torch.zeros_like(k), torch.zeros_like(v)
                attend_backward_into(torch.ones_like(q), q, k, v, out.to(q.dtype), lse, remote,
                                     dq, dk, dv, scale=0.125)  # fmt: skip

            t = fastest_cpu_wall(lambda: None, step, repeat)[0]
            calls = sum(len(tasks) for _, tasks in remote.groups)
            print(f"| {c} | {label} | {calls} | {remote.computed / max(remote.needed, 1):.2f} | "
                  f"{t:.3f} |", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("plans", "prepare", "host", "remote", "all"), default="all")
    p.add_argument("--tokens", type=int, default=1 << 20)
    p.add_argument("--cp", default="8,16,32,64")
    p.add_argument("--rows", type=int, default=32, help="rows of the dense padded 1M batch")
    p.add_argument("--repeat", type=int, default=3, help="plan builds per rank (fastest counts)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--prepare-repeat", type=int, default=20)
    p.add_argument(
        "--model",
        choices=("tiny", "llama32"),
        default="tiny",
        help="prepared model: 1-layer decoder, or a 32-layer HF Llama module tree",
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, torch {torch.__version__}; load average before: "
          f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)  # fmt: skip
    if a.part in ("plans", "all"):
        _plans_part(a.tokens, [int(x) for x in a.cp.split(",")], a.rows, a.repeat)
    if a.part in ("prepare", "all"):
        _prepare_part(a.batch, a.seq, a.ranks, a.prepare_repeat, a.model)
    if a.part in ("host", "all"):
        _host_part(a.batch, a.seq, a.ranks, 15)
    if a.part in ("remote", "all"):
        _remote_part(a.tokens, [int(x) for x in a.cp.split(",")], a.repeat)
    print(f"load average after: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
