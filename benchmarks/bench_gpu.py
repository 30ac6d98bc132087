"""GPU attention benchmark (bf16, fwd+bwd, cp=1) and a several-ranks-on-one-GPU correctness check.

Rows (each: median of timed iterations after warm-up, CUDA events; peak memory from
``torch.cuda.max_memory_allocated`` around one fwd+bwd):

* ``dense``: one causal sequence of S tokens. Baseline: ``F.scaled_dot_product_attention``
  restricted to the flash backend (``enable_gqa``). cpshard kernel: ``block_attention`` +
  ``block_attention_backward`` (the per-block kernel every CP method calls). cpshard
  ``cp_sdpa``: the public CP attention with ``group=None`` (planning included). Target: baseline
  time / cpshard time >= 0.9.
* ``packed``: S tokens of log-normal documents (one 1-token and one >= 5k-token document
  included). Baseline: a loop of flash SDPA calls, one per document. cpshard kernel:
  ``varlen_attention`` + ``varlen_attention_backward`` (one flash varlen call each). Target >= 0.8.
* ``ranks``: ``world`` processes sharing the one GPU, CP group on gloo (collectives staged
  through host memory), ``cp_sdpa`` ring / all_gather on round_robin shards of a packed batch,
  output and gradients compared with one process on the full sequence (max abs error relative to
  the largest reference value, per tensor; bf16 target < 2e-2).

Usage::

    PYTHONPATH=src python benchmarks/bench_gpu.py [--out FILE]   # on a CUDA machine
    PYTHONPATH=src python benchmarks/bench_gpu.py --dry-run      # CPU, tiny: code paths only

``--dry-run`` runs every path on CPU with tiny sizes (and forces host staging for the ranks), so
the script cannot crash on its first GPU run for reasons a CPU can reveal. Its numbers mean
nothing.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from cpshard.attention import cp_sdpa
from cpshard.attention.kernels import block_attention, block_attention_backward
from cpshard.layouts.closed_form import RoundRobinLayout
from cpshard.sharding.meta import TokenMeta
from cpshard.tools.launch import LocalRanks, RankFailure

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _varlen_kernels import varlen_attention, varlen_attention_backward

HQ, HKV, D = 16, 4, 128
DTYPE = torch.bfloat16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of ``fn`` (synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak_bytes(fn: Callable[[], Any], device: torch.device) -> float:
    """Peak bytes allocated during one call, above what was allocated before (CUDA only)."""
    if device.type != "cuda":
        return float("nan")
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return float(torch.cuda.max_memory_allocated(device) - base)


def _flash_ctx(device: torch.device) -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION if device.type == "cuda" else SDPBackend.MATH)


def _doc_lengths(s: int, seed: int) -> list[int]:
    """Log-normal document lengths summing to ``s``, with a 1-token and a >= 5k-token document."""
    g = torch.Generator().manual_seed(seed)
    big = min(5120, s // 4)
    lens = [1, big]
    rest = s - sum(lens)
    while rest > 0:
        n = int(torch.empty(1).log_normal_(math.log(max(s // 64, 8)), 1.0, generator=g).item())
        n = max(1, min(n, rest))
        lens.append(n)
        rest -= n
    perm = torch.randperm(len(lens), generator=g).tolist()
    return [lens[i] for i in perm]


def _qkv(s: int, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = [(1, HQ, s, D), (1, HKV, s, D), (1, HKV, s, D), (1, HQ, s, D)]
    return [torch.randn(sh, generator=g, device=device, dtype=DTYPE) for sh in shapes]


def _meta_single(doc_lens: list[int], device: torch.device) -> TokenMeta:
    s = sum(doc_lens)
    docs = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    return TokenMeta(0, 1, torch.arange(s)[None], docs[None]).to(device)


def _row(
    case: str, s: int, docs: int, base: float, ours: float, target: float, mem: float, what: str
) -> dict[str, Any]:
    ratio = base / ours if ours > 0 else float("nan")
    return {
        "case": case, "S": s, "docs": docs, "what": what, "base_ms": base * 1e3,
        "ours_ms": ours * 1e3, "ratio": ratio, "target": target, "mem": mem,
        "met": "yes" if ratio >= target else "no",
    }  # fmt: skip


def _measure(
    case: str,
    s: int,
    docs: int,
    target: float,
    base: Callable[[], None],
    paths: dict[str, Callable[[], None]],
    device: torch.device,
    warmup: int,
    iters: int,
) -> list[dict[str, Any]]:
    """One row per cpshard path: time and peak memory as ratios to ``base``."""
    tb = _time(base, device, warmup, iters)
    mb = _peak_bytes(base, device)
    rows = []
    for what, fn in paths.items():
        try:
            t = _time(fn, device, warmup, iters)
            rows.append(_row(case, s, docs, tb, t, target, _peak_bytes(fn, device) / mb, what))
        except Exception as e:  # a failing row is reported, the others still run
            rows.append({"case": case, "S": s, "what": what, "error": _short(e)})
    return rows


def bench_dense(s: int, device: torch.device, warmup: int, iters: int) -> list[dict[str, Any]]:
    q, k, v, go = _qkv(s, device)
    sc = D**-0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def base() -> None:
        with _flash_ctx(device):
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, leaves, go)

    def kernel() -> None:
        out, lse = block_attention(q, k, v, mask=None, is_causal=True, scale=sc)
        block_attention_backward(go, q, k, v, out, lse, mask=None, is_causal=True, scale=sc)

    meta = _meta_single([s], device)

    def public() -> None:
        out = cp_sdpa(*leaves, group=None, meta=meta, method="all_gather")
        torch.autograd.grad(out, leaves, go)

    paths = {"block_attention": kernel, "cp_sdpa": public}
    return _measure("dense", s, 1, 0.9, base, paths, device, warmup, iters)


def bench_packed(s: int, device: torch.device, warmup: int, iters: int) -> list[dict[str, Any]]:
    lens = _doc_lengths(s, seed=s)
    q, k, v, go = _qkv(s, device, seed=1)
    sc = D**-0.5
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_d = cu.to(device)
    mx = max(lens)
    # varlen layout [T, H, D] (views of the same data)
    qv, kv, vv, gv = (t[0].transpose(0, 1) for t in (q, k, v, go))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    bounds = cu.tolist()

    def base() -> None:
        with _flash_ctx(device):
            outs = [
                F.scaled_dot_product_attention(
                    *(t[:, :, a:b] for t in leaves), is_causal=True, enable_gqa=True
                )
                for a, b in itertools.pairwise(bounds)
            ]
        torch.autograd.grad(outs, leaves, [go[:, :, a:b] for a, b in itertools.pairwise(bounds)])

    def kernel() -> None:
        out, lse = varlen_attention(qv, kv, vv, cu_d, cu_d, mx, mx, causal=True, scale=sc)
        varlen_attention_backward(
            gv, qv, kv, vv, out, lse, cu_d, cu_d, mx, mx, causal=True, scale=sc
        )

    meta = _meta_single(lens, device)

    def public() -> None:
        out = cp_sdpa(*leaves, group=None, meta=meta, method="all_gather")
        torch.autograd.grad(out, leaves, go)

    paths = {"varlen_attention": kernel, "cp_sdpa": public}
    return _measure("packed", s, len(lens), 0.8, base, paths, device, warmup, iters)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


# --- several ranks on one GPU ----------------------------------------------------------------


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.float().abs().max()) or 1.0
    return float((got.float() - want.float()).abs().max()) / scale


def _rank_errs(mesh: Any, s: int, dev: str, force: bool) -> dict[str, float]:
    """One CP rank on ``dev`` (every rank on the same device): relative errors per method."""
    if force:  # the dry run stages CPU tensors too, through the same code path as CUDA ones
        from unittest import mock

        from cpshard import _comm

        mock.patch.object(_comm, "_transport", return_value=torch.device("cpu")).start()
    rank, world = mesh.get_local_rank(), mesh.size()
    device = torch.device(dev)
    if device.type == "cuda":
        # set_device needs an index ("cuda" alone raises); every rank shares this GPU.
        device = torch.device("cuda", 0 if device.index is None else device.index)
        torch.cuda.set_device(device)
    lens = _doc_lengths(s, seed=7)
    q, k, v, go = _qkv(s, device, seed=2)
    meta_full = _meta_single(lens, device)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = cp_sdpa(*full, group=None, meta=meta_full, method="all_gather")
    ref_g = torch.autograd.grad(ref, full, go)
    rmap = RoundRobinLayout().rank_map(world, s)
    stream = rmap.reshape(-1)
    docs = meta_full.document_ids[0].cpu()
    meta = TokenMeta(rank, world, stream[None], docs[stream][None]).to(device)
    idx = rmap[rank].to(device)
    errs = {}
    for method in ("ring", "all_gather"):
        local = [t.index_select(2, idx).clone().requires_grad_() for t in (q, k, v)]
        out = cp_sdpa(*local, group=mesh.get_group(), meta=meta, method=method)
        grads = torch.autograd.grad(out, local, go.index_select(2, idx))
        pairs = [(out, ref), *zip(grads, ref_g, strict=True)]
        errs[method] = max(_rel_err(a.detach(), b.detach().index_select(2, idx)) for a, b in pairs)
    return errs


def bench_ranks(
    world: int, s: int, device: torch.device, force: bool, timeout_s: float = 60.0
) -> list[dict[str, Any]]:
    """Several gloo ranks on one device (spawned: CUDA cannot be forked), against one process."""
    try:
        with LocalRanks(world, pg_timeout_s=45.0, start_method="spawn") as ranks:
            got = ranks.run(_rank_errs, s, str(device), force, timeout_s=timeout_s)
    except RankFailure as e:
        errors = [
            f"rank {o.rank}: {(o.detail.strip().splitlines() or [o.status])[-1]}"
            for o in e.outcomes
            if o.status != "ok"
        ]
        return [
            {"case": f"ranks={world}", "S": s, "what": "cp_sdpa gloo", "error": "; ".join(errors)}
        ]
    rows = []
    for method in ("ring", "all_gather"):
        err = max(e[method] for e in got)
        rows.append({
            "case": f"ranks={world}", "S": s, "what": f"cp_sdpa {method} (gloo, host staged)",
            "max_err": err, "met": "yes" if err < 2e-2 else "no",
        })  # fmt: skip
    return rows


def _table(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        header, "",
        "| case | S | docs | cpshard path | flash baseline ms | cpshard ms | speed vs flash "
        "| target | peak mem vs flash | met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['case']} | {r['S']} | | {r['what']} | | | error: {r['error']} | | | no |"
            )
        elif "max_err" in r:
            lines.append(
                f"| {r['case']} | {r['S']} | | {r['what']} | | | rel. err vs 1 process "
                f"{r['max_err']:.2e} | < 2e-2 (bf16) | | {r['met']} |"
            )
        else:
            lines.append(
                f"| {r['case']} | {r['S']} | {r['docs']} | {r['what']} | {r['base_ms']:.1f} | "
                f"{r['ours_ms']:.1f} | {r['ratio']:.2f}x | >= {r['target']} | {r['mem']:.2f} | "
                f"{r['met']} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: code paths only")
    ap.add_argument("--sizes", default="32768,131072", help="comma-separated S (GPU)")
    ap.add_argument("--world", type=int, default=2, help="ranks sharing the GPU")
    ap.add_argument("--out", default="", help="also write the table to this file")
    ap.add_argument(
        "--budget-s", type=float, default=140.0,
        help="start no new step after this many seconds (the rest is reported as skipped)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.dry_run:
        device, sizes, warmup, iters, rank_s = torch.device("cpu"), [256], 0, 1, 128
        name = "CPU dry run (numbers meaningless)"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --dry-run on CPU")
        device = torch.device("cuda", torch.cuda.current_device())
        sizes = [int(x) for x in args.sizes.split(",")]
        warmup, iters, rank_s = 2, 5, 8192
        name = torch.cuda.get_device_name(device)
    header = (
        f"GPU: {name}; torch {torch.__version__}; bf16, B=1, Hq={HQ}, Hkv={HKV}, D={D}, causal, "
        f"fwd+bwd, median of {iters} after {warmup} warm-up"
    )
    # Correctness of several ranks on the one GPU first (small, and the point of the run), then
    # the timings from small to large; the table is rewritten after every step, so a run cut
    # short by the caller's timeout still leaves every finished row in --out.
    steps: list[tuple[str, int, Callable[[], list[dict[str, Any]]]]] = [
        (f"ranks={args.world}", rank_s,
         lambda: bench_ranks(args.world, rank_s, device, force=args.dry_run)),
    ]  # fmt: skip
    for s in sizes:
        steps.append(("dense", s, lambda s=s: bench_dense(s, device, warmup, iters)))
        steps.append(("packed", s, lambda s=s: bench_packed(s, device, warmup, iters)))
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    for case, s, step in steps:
        if time.monotonic() - start > args.budget_s:
            rows.append({"case": case, "S": s, "what": "-", "error": "skipped: time budget"})
            continue
        try:
            rows += step()
        except Exception as e:  # e.g. the baseline itself failed or ran out of memory
            rows.append({"case": case, "S": s, "what": "-", "error": _short(e)})
        if device.type == "cuda":
            torch.cuda.empty_cache()
        table = _table(rows, header)
        print(table + "\n", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(table + "\n")


if __name__ == "__main__":
    main()
