"""``cpshard parity``: loss and gradient parity per CP attention method and layout.

For every (batch kind, layout, attention method) it trains the same tiny model for a few steps
on N local gloo ranks and on one rank, through the same code, and compares the global losses of
every step and the CP-reduced gradients of the first step.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Literal

from cpshard.cli._spawn import run_local_ranks
from cpshard.parity import (
    HEADS,
    KV_HEADS,
    ParityCase,
    ParityResult,
    compare,
    native_steps,
    train_steps,
)

_METHODS = ("all_gather", "ring", "ulysses")
_DENSE = ("round_robin", "contiguous")
_PACKED = ("balanced", "packed")
_TOL = {"float32": (2e-4, 2e-4), "float64": (1e-9, 1e-9)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``cpshard parity``."""
    p.add_argument("--ranks", type=int, default=4, help="CP size (default 4)")
    p.add_argument("--model", choices=("llama", "qwen2", "tiny"), default="llama")
    p.add_argument("--methods", default=",".join(_METHODS), help="comma-separated")
    p.add_argument(
        "--layouts",
        default=",".join(_DENSE + _PACKED),
        help="comma-separated; round_robin/contiguous use dense rows, balanced/packed packed rows",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--dtype", choices=tuple(_TOL), default="float32")
    p.add_argument("--seed", type=int, default=0)


def _csv(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise SystemExit(f"cpshard parity: --{what} takes a comma list of {allowed}, got {text!r}")
    return items


def _run(world: int, case: ParityCase) -> ParityResult:
    result: ParityResult = run_local_ranks(world, train_steps, case)[0]
    return result


def _native(cp_mesh: object, case: ParityCase) -> ParityResult:
    del cp_mesh  # one process, no collective: the model's own attention
    return native_steps(case)


def run(args: argparse.Namespace) -> int:
    """Run every parity case; exit status 0 iff all of them agree within tolerance."""
    if args.model != "tiny":
        import transformers  # noqa: F401  (imported once here, before the ranks fork)
    methods = _csv(args.methods, _METHODS, "methods")
    layouts = _csv(args.layouts, _DENSE + _PACKED, "layouts")
    base = ParityCase(
        model=args.model,
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        dtype=args.dtype,
        seed=args.seed,
    )
    tol_loss, tol_grad = _TOL[args.dtype]
    print(
        f"cpshard parity: {args.model} ({HEADS} heads, {KV_HEADS} KV heads), {args.dtype}, "
        f"{args.ranks} gloo ranks vs 1, {args.steps} AdamW steps, corpus batches "
        f"[{args.batch_size}, {args.seq_len}]\n"
    )
    print(
        "| batch | layout | attention | local tokens | losses (cp=N) | max dloss | grad err | ok |"
    )
    print("|---|---|---|---|---|---|---|---|")
    refs: dict[str, ParityResult] = {}
    all_ok = True
    t0 = time.perf_counter()
    for layout in layouts:
        kind: Literal["dense", "packed"] = "dense" if layout in _DENSE else "packed"
        if kind not in refs:
            refs[kind] = _run(1, replace(base, batch=kind))
            # the cp=1 reference itself against the model's own attention, without cpshard
            native = run_local_ranks(1, _native, replace(base, batch=kind))[0]
            dloss, dgrad = compare(native, refs[kind])
            ok = dloss <= tol_loss and dgrad <= tol_grad
            all_ok &= ok
            losses = " ".join(f"{x:.4f}" for x in refs[kind].losses)
            print(
                f"| {kind} | cp=1 vs native attention | - | {refs[kind].local_tokens} | "
                f"{losses} | {dloss:.2e} | {dgrad:.2e} | {'yes' if ok else 'NO'} |"
            )
        for method in methods:
            if method == "ulysses" and (HEADS % args.ranks or KV_HEADS % args.ranks):
                print(
                    f"| {kind} | {layout} | {method} | - | - | - | - | skipped: heads "
                    f"{HEADS}/{KV_HEADS} not divisible by {args.ranks} ranks |"
                )
                continue
            case = replace(base, batch=kind, layout=layout, method=method)  # type: ignore[arg-type]
            got = _run(args.ranks, case)
            dloss, dgrad = compare(refs[kind], got)
            ok = dloss <= tol_loss and dgrad <= tol_grad
            all_ok &= ok
            losses = " ".join(f"{x:.4f}" for x in got.losses)
            print(
                f"| {kind} | {got.layout} | {method} | {got.local_tokens} | {losses} | "
                f"{dloss:.2e} | {dgrad:.2e} | {'yes' if ok else 'NO'} |"
            )
    ref_losses = "; ".join(
        f"{k}: " + " ".join(f"{x:.4f}" for x in r.losses) for k, r in refs.items()
    )
    print(f"\nreference losses (cp=1): {ref_losses}")
    print(f"tolerance: dloss <= {tol_loss:g}, grad err (max |dg| / max |g|) <= {tol_grad:g}")
    print(f"{'PASS' if all_ok else 'FAIL'} in {time.perf_counter() - t0:.1f} s")
    return 0 if all_ok else 1
