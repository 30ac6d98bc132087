"""Balance metrics of packed layouts, and torch's own load balancers measured the same way.

For a :class:`~cpshard.layouts.packed.PackedPlan`:

* **causal work** of a rank: the number of (query, key) pairs it computes under the
  document-causal mask, i.e. ``sum(position + 1)`` over its real query tokens (pads cost 0);
* **imbalance**: ``max / mean`` work over ranks (1.0 is perfect);
* **padding overhead**: ``(P - real) / real``;
* **remote K/V** of rank ``r``: key tokens that ``r``'s queries attend to but that live on other
  ranks, divided by ``P`` (what a selective K/V exchange must move; all-gather and ring move
  ``(C - 1) / C`` regardless).

torch 2.13's balancers (``torch.distributed.tensor.experimental._context_parallel``) are driven
as index generators on CPU and sharded the way torch shards: a contiguous cut of the rearranged
sequence. ``_PerDocumentHeadTailLoadBalancer`` is measured as it really behaves (its indices are
document-major, so a contiguous cut hands out whole documents). ``_PTRRLoadBalancer`` needs a
compiled ``BlockMask``; instead its own scheduler ``ptrr_scheduling`` is fed the exact per-block
counts ``kv_num_blocks + full_kv_num_blocks`` a 128-token document-causal BlockMask has.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from cpshard import _compat
from cpshard.layouts.balanced import plan_balanced
from cpshard.layouts.closed_form import ContiguousLayout, RoundRobinLayout
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.index import check_rank_map, padded_length
from cpshard.layouts.packed import PackedPlan, plan_closed_form, plan_from_stream, plan_packed

__all__ = [
    "COLUMNS",
    "DISTRIBUTIONS",
    "BalanceReport",
    "all_plans",
    "balance_report",
    "corpus_doc_lengths",
    "rank_work",
    "remote_kv_tokens",
    "sample_packed_batch",
    "torch_balancer_plans",
]

PTRR_BLOCK = 128

# Every column of the balance table (``cpshard balance``), defined once for its output and --help.
COLUMNS: dict[str, str] = {
    "batch": "the packed batch: length distribution, tokens per row, sampling seed",
    "C": "CP size (number of ranks)",
    "layout": "how tokens are assigned to ranks (torch_*: torch 2.13's own load balancers)",
    "imbalance": "max / mean causal attention work per rank; work = (query, key) pairs under "
    "the document-causal mask; 1.0 is perfect, the slowest rank sets the step time",
    "padding": "(padded length - real tokens) / real tokens: extra slots the layout adds",
    "remote K/V max": "max over ranks of the key tokens its queries attend to that live on "
    "other ranks, / padded length (what a selective K/V exchange moves; all-gather and ring "
    "move (C-1)/C regardless)",
    "remote K/V mean": "the same, averaged over ranks",
    "plan ms": "wall time to build the layout's plan (rank map, stream facts, checks), "
    "after one untimed warm-up pass over every layout",
}
DISTRIBUTIONS = ("lognormal", "corpus")
LOGNORMAL_MU = 7.5
LOGNORMAL_SIGMA = 1.2


@dataclass(frozen=True)
class BalanceReport:
    """Balance of one layout on one packed batch.

    Attributes:
        layout: Layout label.
        world_size: CP size ``C``.
        real_tokens: Non-pad tokens of the batch.
        padded_len: ``P``.
        work_per_rank: Causal (query, key) pairs per rank, rank order.
        imbalance: ``max / mean`` of ``work_per_rank``.
        padding_overhead: ``(P - real) / real``.
        remote_kv_max: Max over ranks of remote key tokens needed, divided by ``P``.
        remote_kv_mean: Mean over ranks of the same.
        solver_seconds: Time spent building the plan.
    """

    layout: str
    world_size: int
    real_tokens: int
    padded_len: int
    work_per_rank: tuple[int, ...]
    imbalance: float
    padding_overhead: float
    remote_kv_max: float
    remote_kv_mean: float
    solver_seconds: float


def rank_work(plan: PackedPlan) -> torch.Tensor:
    """LongTensor ``[C]``: causal work of every rank's real queries."""
    return plan.token_work()[plan.rank_map].sum(dim=1)


def remote_kv_tokens(plan: PackedPlan) -> torch.Tensor:
    """LongTensor ``[C]``: key tokens each rank needs from other ranks.

    Rank ``r``'s queries in document ``d`` reach keys ``0..m`` of ``d``, ``m`` the largest
    position ``r`` holds in ``d``; ``r`` itself holds ``n`` of them, so it needs ``m + 1 - n``.
    """
    c, n_local = plan.rank_map.shape
    rank_of = torch.empty(plan.padded_len, dtype=torch.long)
    rank_of[plan.rank_map.reshape(-1)] = torch.arange(c).repeat_interleave(n_local)
    doc = plan.stream_document_ids
    real = doc >= 0
    if not bool(real.any()):
        return torch.zeros(c, dtype=torch.long)
    n_docs = int(doc.max()) + 1
    key = rank_of[real] * n_docs + doc[real]
    pos = plan.stream_position_ids[real]
    top = torch.full((c * n_docs,), -1, dtype=torch.long).scatter_reduce(
        0, key, pos, reduce="amax", include_self=True
    )
    held = torch.zeros(c * n_docs, dtype=torch.long).index_add_(0, key, torch.ones_like(key))
    need = torch.where(held > 0, top + 1 - held, 0)
    return need.view(c, n_docs).sum(dim=1)


def balance_report(plan: PackedPlan) -> BalanceReport:
    """Metrics of ``plan`` (see the module docstring).

    Args:
        plan: A layout of a packed batch with at least one real token.
    """
    real_tokens = int((plan.stream_document_ids >= 0).sum())
    work = rank_work(plan)
    remote = remote_kv_tokens(plan).double() / plan.padded_len
    mean = float(work.double().mean())
    return BalanceReport(
        layout=plan.layout,
        world_size=plan.world_size,
        real_tokens=real_tokens,
        padded_len=plan.padded_len,
        work_per_rank=tuple(int(w) for w in work),
        imbalance=float(work.max()) / mean if mean > 0 else 1.0,
        padding_overhead=(plan.padded_len - real_tokens) / real_tokens,
        remote_kv_max=float(remote.max()),
        remote_kv_mean=float(remote.mean()),
        solver_seconds=plan.solver_seconds,
    )


def _ptrr_block_counts(plan: PackedPlan, block: int) -> torch.Tensor:
    """Non-empty KV blocks per Q block of a document-causal mask (pads see only themselves)."""
    first = torch.arange(0, plan.padded_len, block)
    doc = plan.stream_document_ids[first]
    start = first - plan.stream_position_ids[first]
    q_blk = first // block
    return torch.where(doc >= 0, q_blk - start // block + 1, 1)


def torch_balancer_plans(spec: PackSpec, world_size: int) -> list[PackedPlan]:
    """torch 2.13's load balancers on ``spec``, or ``[]`` when torch does not ship them.

    Returns:
        Plans labelled ``torch_head_tail`` (stream padded to ``2C``), ``torch_per_document``
        (documents padded to ``2C`` as torch requires; doc-major indices cut contiguously) and
        ``torch_ptrr`` (stream padded to ``128 * C``; 128-token blocks).
    """
    if not _compat.torch_load_balancers_available():  # pragma: no cover - the torch build
        return []
    c = world_size
    plans = []

    t0 = time.perf_counter()
    padded = padded_length(spec.real_tokens, 2 * c)
    idx = _compat.torch_head_tail_indices(padded, c)
    plan = plan_from_stream(spec, "torch_head_tail", idx.reshape(c, -1).long())
    plans.append(replace(plan, solver_seconds=time.perf_counter() - t0))

    t0 = time.perf_counter()
    doc_padded = (spec.lengths() + 2 * c - 1) // (2 * c) * (2 * c)
    idx = _compat.torch_per_document_indices(doc_padded.tolist(), c)
    plan = plan_from_stream(spec, "torch_per_document", idx.reshape(c, -1).long(), doc_padded)
    plans.append(replace(plan, solver_seconds=time.perf_counter() - t0))

    t0 = time.perf_counter()
    padded = padded_length(spec.real_tokens, PTRR_BLOCK * c)
    base = plan_from_stream(spec, "torch_ptrr", torch.arange(padded).reshape(c, -1))
    counts = _ptrr_block_counts(base, PTRR_BLOCK)
    groups = _compat.torch_ptrr_schedule(counts, c)  # [C, blocks / C]
    rank_map = (groups.unsqueeze(-1) * PTRR_BLOCK + torch.arange(PTRR_BLOCK)).reshape(c, -1)
    check_rank_map(rank_map, padded)
    plan = replace(base, rank_map=rank_map.long())
    plans.append(replace(plan, solver_seconds=time.perf_counter() - t0))
    return plans


def all_plans(spec: PackSpec, world_size: int, include_torch: bool = True) -> list[PackedPlan]:
    """Every layout on one packed batch: ``contiguous``, ``round_robin`` (global head-tail),
    ``packed`` (TE), ``balanced`` (ours), then torch's balancers when available."""
    plans = [
        plan_closed_form(spec, world_size, ContiguousLayout()),
        plan_closed_form(spec, world_size, RoundRobinLayout()),
        plan_packed(spec, world_size),
        plan_balanced(spec, world_size),
    ]
    if include_torch:
        plans.extend(torch_balancer_plans(spec, world_size))
    return plans


def corpus_doc_lengths() -> tuple[int, ...]:
    """Byte lengths of the 79 documents of CPython's ``pydoc_data.topics`` (real English),
    in :func:`cpshard.tools.corpus.document_lengths` order."""
    from cpshard.tools.corpus import document_lengths

    return tuple(document_lengths())


def sample_packed_batch(distribution: str, tokens: int, seed: int) -> PackSpec:
    """One packed ``[1, tokens]`` row of documents drawn from a length distribution.

    Documents are drawn until the row is full; the last one is cut to fit, so the row has no
    padding.

    Args:
        distribution: ``"lognormal"`` (``exp(N(7.5, 1.2))`` tokens, rounded, ``>= 1``) or
            ``"corpus"`` (lengths of :func:`corpus_doc_lengths`, drawn with replacement).
        tokens: Row length, ``>= 1``.
        seed: Seed of the numpy generator; the batch is a pure function of the arguments.
    """
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got tokens={tokens}")
    rng = np.random.default_rng(seed)
    corpus: Sequence[int] = ()
    if distribution == "corpus":
        corpus = corpus_doc_lengths()
    elif distribution != "lognormal":
        raise ValueError(
            f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}; "
            "or pass explicit lengths with PackSpec.from_seq_lens"
        )
    lens: list[int] = []
    total = 0
    while total < tokens:
        if corpus:
            n = int(corpus[int(rng.integers(len(corpus)))])
        else:
            n = max(1, round(float(np.exp(rng.normal(LOGNORMAL_MU, LOGNORMAL_SIGMA)))))
        n = min(n, tokens - total)
        lens.append(n)
        total += n
    return PackSpec.from_seq_lens([lens], tokens)
