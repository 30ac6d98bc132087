"""The cost model behind ``attention="auto"``: modelled step time of each method from the plan.

For one attention layer, forward and backward, on every rank ``r`` of ``C`` (``L`` tokens each):

* **compute**: ``pairs_r`` visible query-key pairs of ``r``'s queries (from the token meta, exact)
  plus ``pad_pairs_r``, the pairs the kernels compute beyond those on ``r``'s padding (a pad sees
  only itself, but a stretch of ``m`` pads runs as identity-masked diagonals of at most
  :data:`~cpshard.attention.pieces.PAD_TILE`: ``sum(tile**2)`` pairs, not ``m``), ``4 * D * Hq``
  FLOP per pair forward and :data:`BACKWARD_FACTOR` times that backward, at ``compute_rate``
  FLOP/s. ``all_gather``, ``ring`` and ``selective`` compute the same pairs; ``ulysses``
  computes ``1/C`` of the heads of every pair of the stream (perfectly balanced; its pad
  diagonals taken as the ranks' together, exact where each rank's pad stretches are whole
  tiles).
* **communication**: bytes over ``link_bandwidth`` (bytes/s one rank receives, or sends, at
  once), plus ``latency`` per collective or ring step. Forward K/V move in the input dtype, the
  backward's dK/dV in the fp32 accumulation dtype (fp64 for fp64).

  - ``all_gather``: ``(C-1) * L`` K/V slots in, the reduce-scatter of as many dK/dV out;
  - ``selective``: the slots ``r``'s queries see in and those peers need of ``r`` out (the larger
    of the two bounds the all-to-all), forward and (dK/dV) backward;
  - ``ring``: ``C-1`` hops of ``L`` K/V slots forward; backward K/V and dK/dV travel together;
  - ``ulysses``: q, k, v to heads and the output back, forward; grad-out in and dq, dk, dv out,
    backward; each ``(C-1)/C`` of the local tensors.
* **passes**: with ``CostModel.pass_rate`` finite, each pass over a rank's queries (reading q,
  writing a partial output and merging it) costs ``L * B * Hq * D / pass_rate`` forward and
  :data:`BACKWARD_FACTOR` times that backward, unhidden: all_gather and selective 2 passes (own
  keys, remote keys), ring ``C``, ulysses 1.
* **overlap**: ``all_gather`` and ``selective`` hide their exchange behind the own-keys compute
  (``max(comm, local) + remote``); ``ring`` hides each hop behind one block's compute, step by
  step (the remote pairs spread evenly over the ``C - 1`` remote blocks; the last block's compute
  and the gradient accumulators' last hop are not hidden); ``ulysses`` hides nothing. With
  ``CostModel.overlap = f < 1`` only ``f`` of a transfer can hide (``comm + work -
  min(f * comm, work)``): a transport that moves bytes on the cores that compute (gloo on CPU)
  hides little.
* **CPU terms** (each ``inf`` by default: no cost, the GPU default model is unchanged):

  - ``CostModel.block_rate``: the CPU flash kernels' work per block (:class:`KernelBlocks`: a
    call of ``nq`` queries runs query blocks of 32/64/256 queries, each against the 512-key
    blocks up to its last visible key), per query head and row, forward and
    :data:`BACKWARD_FACTOR` times that backward, unhidden. all_gather, selective and ring cut
    the keys at the rank blocks (one call per query run and key run: each rank's
    :attr:`KernelBlocks.every`); ulysses runs the whole stream's blocks, joined by position,
    with ``1/C`` of the heads. Short query runs (small query blocks) cost more per pair: what
    makes a batch of a few long documents cut in many pieces slower per pair at larger ``C``.
  - ``CostModel.gather_bandwidth``: all_gather's gathered ``C * L`` K/V slots forward and the
    dK/dV slots it reduce-scatters backward, written and read whole besides the link.
  - ``CostModel.all_to_all_bandwidth``: every byte of Ulysses's all-to-alls costs this besides
    the link (packing the head splits, the pairwise exchanges).

A step lasts as long as its slowest rank: a method's cost is the max over ranks. The model
ignores intra-node vs inter-node topology (one bandwidth for every pair of ranks), contention
between concurrent transfers, and the plans' grouping of small pieces into masked tiles (the block
count counts them one call each: a few percent high on packed short documents); with a sliding
window, or runs that do not tile their documents, the block count is an estimate
(:attr:`KernelBlocks.exact`).

Every input is a global fact of the batch (the token meta every rank holds) or of the call (shapes
and dtype, equal on every rank), so every rank computes the same costs and picks the same method
without a collective. Ties (equal modelled time within :data:`TIE_RTOL`, e.g. every exchange
hidden behind the compute) go to the method that moves the fewest bytes (the busiest rank's,
:func:`method_bytes`, then all ranks' together, :func:`wire_bytes`), then to the first in
:data:`cpshard.names.METHOD_NAMES` order.

Calibration: the rates are measured, not guessed, by ``benchmarks/bench_auto_calibration.py``
(:mod:`cpshard.attention.calibration` fits them to measured step times and prints the table of
predicted vs measured); :meth:`CostModel.cpu_gloo` holds the rates it fitted for CPU ranks
joined by gloo. On GPUs run the same benchmark on the cluster and pass the rates it prints.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from cpshard.attention.methods import METHODS
from cpshard.attention.pieces import PAD_TILE, TILE
from cpshard.attention.selective_plan import MetaArrays, exchange_sums, meta_arrays
from cpshard.attention.visibility import Frame, RankRuns, per_rank, visible_pairs
from cpshard.sharding.meta import TokenMeta

__all__ = [
    "BACKWARD_FACTOR",
    "CPU_GLOO_RATES",
    "TIE_RTOL",
    "CallShape",
    "CostModel",
    "PlanFacts",
    "choose_method",
    "method_bytes",
    "method_costs",
    "pad_tile_pairs",
    "plan_facts",
    "wire_bytes",
]

BACKWARD_FACTOR = 2.5
"""Backward FLOP per forward FLOP of attention (FlashAttention-2: 2.5x)."""

CPU_GLOO_RATES: dict[str, float] = {
    "compute_rate": 4.435e10,
    "link_bandwidth": 2.831e9,
    "latency": 4.36e-31,
    "overlap": 0.0,
    "pass_rate": 1.672e8,
    "block_rate": 3.421e5,
    "gather_bandwidth": 6.485e8,
    "all_to_all_bandwidth": 2.452e8,
}
"""The rates of :meth:`CostModel.cpu_gloo`: fitted by ``benchmarks/bench_auto_calibration.py
--load benchmarks/data/auto_calibration_full_cpu.json --clock cpu`` (the full grid: 27 points,
S 16k/32k/64k x C 2/3/4 x three batch mixes x GQA 8/8, 8/2, 8/1, 4 paired rounds each, the
slowest rank's CPU time per step: what a step takes on a core of its own, whatever the
neighbours' load) on the 2-core x86_64 container, weighted least squares of log time; refitted
once the model charged the pad diagonals the kernels compute (:attr:`PlanFacts.pad_pairs`), then
the CPU flash kernels' blocks (:attr:`PlanFacts.blocks`, ``block_rate``: 2.9 us per block and
head), the all-gather's gathered buffers (``gather_bandwidth``) and Ulysses's all-to-alls
beyond the link (``all_to_all_bandwidth``). Leave-one-point-out, 99% of the 90 (point, method)
times were predicted within 15% (92% before the three terms, 88% before the pad diagonals) and
the measured best method was picked at 93% of the points (BENCHMARKS.md). On the whole grid
measured again after the fit (``benchmarks/data/auto_calibration_full_cpu_run2.json``, never
fitted on) these rates predict 97% of the rows within 15% and pick the measured best at 89% of
the points (the other three within noise). ``latency`` fits to nothing and ``overlap`` to 0 once
the gloo collectives' cost per byte is charged where it falls (a gloo transfer on the cores that
compute hides nothing)."""

_EXTRA_RATES = ("block_rate", "gather_bandwidth", "all_to_all_bandwidth")
"""Rates whose default, ``inf``, charges nothing (the GPU default model)."""

TIE_RTOL = 1e-9
"""Modelled times this close (relative) are a tie, decided by the bytes moved."""


@dataclass(frozen=True)
class CostModel:
    """Hardware rates of the model, and the call shape assumed before the model runs.

    Attributes:
        link_bandwidth: Bytes per second one rank receives (or sends) at once. Default 100 GB/s:
            between NVLink inside a node (~450 GB/s) and InfiniBand across nodes (~50 GB/s).
        compute_rate: Attention FLOP per second per rank. Default 400 TFLOP/s (bf16
            FlashAttention on an H100/H200 class GPU).
        latency: Seconds per collective or ring step. Default 20 us.
        overlap: Share of a transfer that can hide behind compute, in ``[0, 1]``. Default 1 (GPU:
            NCCL on its own engines); gloo on CPU moves bytes on the computing cores.
        pass_rate: Query elements (``tokens * Hq * D`` of the call) per second one pass over the
            queries costs besides its pairs: reading q and writing a partial output and its LSE,
            merging it, and the backward's share (see :func:`method_costs`: all_gather and
            selective make 2 passes, ring ``C``, ulysses 1). Default ``inf`` (no cost: on GPUs the
            fused kernels hide it); on CPU it is what makes a batch of short documents (few pairs
            per token) slower per pair than one of long documents.
        block_rate: Kernel blocks (:class:`KernelBlocks`, per query head and batch row) per
            second the CPU flash kernels' per-block work runs at besides the pairs: each block's
            setup, its softmax rescale and the partial rows of small query blocks (forward, and
            :data:`BACKWARD_FACTOR` times as much backward). Default ``inf`` (no cost); on CPU
            it makes a method slower per pair where its calls are cut small (small query blocks
            of short query runs).
        gather_bandwidth: Bytes per second of the all-gather's own memory traffic besides the
            link: the gathered ``C * L`` K/V slots (forward) and dK/dV slots (backward,
            reduce-scattered) written and read whole. Default ``inf`` (no cost: on GPUs the
            buffers stream at HBM rate, far above the link's).
        all_to_all_bandwidth: Bytes per second of Ulysses's all-to-alls besides the link (each
            of its bytes costs ``1 / link_bandwidth + 1 / all_to_all_bandwidth``): the head
            splits packed and unpacked, the pairwise exchanges. Default ``inf`` (no cost).
        q_heads: Query heads assumed where the call is not known yet (the dispatcher).
        kv_heads: Key/value heads assumed likewise.
        head_dim: Head dim assumed likewise.
        itemsize: Bytes per element assumed likewise (2: bf16).
    """

    link_bandwidth: float = 100e9
    compute_rate: float = 400e12
    latency: float = 20e-6
    overlap: float = 1.0
    pass_rate: float = math.inf
    block_rate: float = math.inf
    gather_bandwidth: float = math.inf
    all_to_all_bandwidth: float = math.inf
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    itemsize: int = 2

    def __post_init__(self) -> None:
        for name in ("link_bandwidth", "compute_rate", "pass_rate", *_EXTRA_RATES):
            value = getattr(self, name)
            if not value > 0:
                fix = "; pass math.inf for no cost" if name in _EXTRA_RATES else ""
                raise ValueError(
                    f"CostModel.{name} must be > 0 (a rate, per second{fix}), got {value!r}"
                )
        if self.latency < 0:
            raise ValueError(f"CostModel.latency must be >= 0, got {self.latency!r}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"CostModel.overlap must be in [0, 1], got {self.overlap!r}")
        for name in ("q_heads", "kv_heads", "head_dim", "itemsize"):
            if getattr(self, name) < 1:
                raise ValueError(f"CostModel.{name} must be >= 1, got {getattr(self, name)!r}")

    @classmethod
    def cpu_gloo(cls, share: float = 1.0) -> CostModel:
        """Rates fitted for CPU ranks (1 thread each, the CPU flash kernels) joined by gloo.

        Fitted by ``benchmarks/bench_auto_calibration.py`` on a 2-core x86_64 container
        (:data:`CPU_GLOO_RATES`; BENCHMARKS.md: the grid, the load, the residuals); rerun it on
        your machine for yours. The rates are per core of its own; ``share`` slows them for ranks
        that share cores.

        Args:
            share: Share of a core each rank gets (``cores / ranks`` where ranks outnumber the
                cores; :meth:`scaled`).
        """
        return cls(
            compute_rate=CPU_GLOO_RATES["compute_rate"],
            link_bandwidth=CPU_GLOO_RATES["link_bandwidth"],
            latency=CPU_GLOO_RATES["latency"],
            overlap=CPU_GLOO_RATES["overlap"],
            pass_rate=CPU_GLOO_RATES["pass_rate"],
            block_rate=CPU_GLOO_RATES["block_rate"],
            gather_bandwidth=CPU_GLOO_RATES["gather_bandwidth"],
            all_to_all_bandwidth=CPU_GLOO_RATES["all_to_all_bandwidth"],
        ).scaled(share)

    def scaled(self, share: float) -> CostModel:
        """This model for ranks that get ``share`` of a core each: compute, pass and block rates,
        link, gather and all-to-all bandwidths times ``share`` (gloo moves bytes with the cores
        that compute)."""
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        if share == 1.0:
            return self
        return dataclasses.replace(
            self,
            compute_rate=self.compute_rate * share,
            link_bandwidth=self.link_bandwidth * share,
            pass_rate=self.pass_rate * share,
            block_rate=self.block_rate * share,
            gather_bandwidth=self.gather_bandwidth * share,
            all_to_all_bandwidth=self.all_to_all_bandwidth * share,
        )

    def needs_blocks(self) -> bool:
        """Whether the model charges kernel blocks (:attr:`block_rate` finite): then the facts
        must count them (``plan_facts(..., blocks=True)``)."""
        return math.isfinite(self.block_rate)

    def shape(self, batch: int, causal: bool = True, window: int | None = None) -> CallShape:
        """The assumed :class:`CallShape` for ``batch`` rows."""
        return CallShape(
            batch, self.q_heads, self.kv_heads, self.head_dim, self.itemsize, causal, window
        )


@dataclass(frozen=True)
class CallShape:
    """What one attention call looks like (equal on every rank).

    Attributes:
        batch: Rows ``B`` of q/k/v.
        q_heads: ``Hq``.
        kv_heads: ``Hkv``.
        head_dim: ``D``.
        itemsize: Bytes per element of q/k/v.
        causal: Causal masking.
        window: Sliding window or ``None``.
    """

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    causal: bool = True
    window: int | None = None


@dataclass(frozen=True)
class PlanFacts:
    """Global per-rank facts of one batch and mask, identical on every rank.

    Attributes:
        world: CP size ``C``.
        local_len: Tokens per rank ``L``.
        meta_rows: Rows of the token meta (1: one structure for every batch row).
        pairs: ``[C]`` visible query-key pairs of each rank's queries (summed over meta rows).
        local_pairs: ``[C]`` of those, the pairs whose key is on the same rank.
        recv_slots: ``[C]`` remote key slots each rank's queries see (what selective receives;
            :func:`~cpshard.attention.selective_plan.exchange_sums`).
        send_slots: ``[C]`` key slots each rank's peers need from it (what selective sends).
        pad_pairs: ``[C]`` pairs each rank's kernels compute beyond the visible ones on its pad
            diagonals (:func:`pad_tile_pairs`; on the rank's own keys, like every pad pair), or
            ``None``: not known, 0.
    """

    world: int
    local_len: int
    meta_rows: int
    pairs: np.ndarray
    local_pairs: np.ndarray
    recv_slots: np.ndarray
    send_slots: np.ndarray
    pad_pairs: np.ndarray | None = None
    blocks: KernelBlocks | None = None


@dataclass(frozen=True)
class KernelBlocks:
    """Blocks of the CPU flash kernels the methods' kernel calls run (per query head and meta row,
    summed over the meta rows like the pairs): a call of ``nq`` queries against ``nk`` keys runs
    query blocks of :func:`query_block` queries, each against the :data:`KV_BLOCK`-key blocks up
    to its last visible key (:func:`full_blocks`, :func:`causal_blocks`, :func:`pad_blocks`).

    Attributes:
        own: ``[C]`` blocks of each rank's queries against its own keys (the own-keys pass of
            all_gather and selective, the first ring step).
        every: ``[C]`` blocks of each rank's queries against every key (all passes of all_gather,
            selective and ring together: each cuts the keys at the rank blocks, one call per
            query run and key run).
        stream: Blocks of the whole stream against itself as Ulysses cuts it (runs joined by
            position where that halves them): every rank runs them all, with ``1/C`` of the
            heads.
        exact: Counted from the runs (causal or bidirectional without a window, runs that tile
            their documents: every built-in layout); else estimated from each rank's mean
            visible keys per query. Small pieces the plans group into masked tiles count one
            call each, so short documents are over-counted a little.
    """

    own: np.ndarray
    every: np.ndarray
    stream: float
    exact: bool


KV_BLOCK = 512
"""Keys per block of the CPU flash kernels (``kvSplitSize``)."""


def query_block(n: np.ndarray) -> np.ndarray:
    """Queries per block of the CPU flash kernels for calls of ``n`` queries (``qSplitSize``:
    256 from 768 queries, 64 from 192, else 32; each divides :data:`KV_BLOCK`)."""
    out: np.ndarray = np.where(n >= 768, 256, np.where(n >= 192, 64, 32))
    return out


def full_blocks(nq: np.ndarray, nk: np.ndarray) -> np.ndarray:
    """Kernel blocks of calls of ``nq`` queries against ``nk`` keys without a mask pattern the
    kernel skips: every query block against every key block."""
    qs = query_block(nq)
    out: np.ndarray = -(-nq // qs) * -(-nk // KV_BLOCK)
    return out


def causal_blocks(n: np.ndarray) -> np.ndarray:
    """Kernel blocks of causal calls of ``n`` queries against the same ``n`` keys: query block
    ``j`` (queries ``[j * qs, (j + 1) * qs)``) runs the key blocks up to its last query,
    ``ceil(min((j + 1) * qs, n) / KV_BLOCK)`` (a closed form: ``qs`` divides the key block)."""
    qs = query_block(n)
    m = -(-n // qs) - 1  # every query block but the last ends at a multiple of qs
    per = KV_BLOCK // qs
    a, b = np.divmod(m, per)
    out: np.ndarray = per * a * (a + 1) // 2 + b * (a + 1) + -(-n // KV_BLOCK)
    return out


def pad_blocks(lengths: np.ndarray) -> np.ndarray:
    """Kernel blocks of pad runs of ``lengths`` slots: identity diagonals of at most
    :data:`~cpshard.attention.pieces.PAD_TILE` (one key block each)."""
    whole, rest = np.divmod(lengths, PAD_TILE)
    per_tile = int(-(-PAD_TILE // int(query_block(np.asarray(PAD_TILE)))))
    out: np.ndarray = whole * per_tile + np.where(rest > 0, -(-rest // query_block(rest)), 0)
    return out


def pad_tile_pairs(lengths: np.ndarray) -> np.ndarray:
    """Pairs the kernels compute beyond the visible ones for pad runs of ``lengths`` slots.

    A stretch of ``m`` pads (each sees only itself: ``m`` visible pairs) runs as identity-masked
    diagonals of at most :data:`~cpshard.attention.pieces.PAD_TILE` slots, each computed whole:
    ``(m // T) * T**2 + (m % T)**2`` pairs.

    Args:
        lengths: int64 pad run lengths.

    Returns:
        int64, the extra pairs of each run (0 for runs of one pad).
    """
    whole, rest = np.divmod(lengths, PAD_TILE)
    out: np.ndarray = whole * (PAD_TILE * PAD_TILE) + rest * rest - lengths
    return out


def _pads(a: MetaArrays, blocks: bool) -> tuple[np.ndarray | None, np.ndarray | None, float]:
    """``([C] | None, [C], joined)``: :func:`pad_tile_pairs` of every rank's pad runs (``None``
    where the stream has no pad run longer than one slot), their :func:`pad_blocks`, and the
    pad blocks of the runs joined by position (Ulysses's sorted stream; ``None`` and 0 unless
    ``blocks``), each row group's weighted by the meta rows it stands for."""
    runs = [g.runs for g in a.runs]
    if len(runs) == 1:
        pad, n, rank, pos, w = runs[0].pad, runs[0].n, runs[0].rank, runs[0].pos, None
        grp = None
    else:
        pad = np.concatenate([r.pad for r in runs])
        n = np.concatenate([r.n for r in runs])
        rank = np.concatenate([r.rank for r in runs])
        pos = np.concatenate([r.pos for r in runs])
        sizes = [r.n.size for r in runs]
        grp = np.repeat(np.arange(len(runs), dtype=np.int64), sizes)[pad]
        w = np.repeat(a.weights, sizes)[pad]
    n, rank, pos = n[pad], rank[pad], pos[pad]
    counted, joined = None, 0.0
    if blocks:
        each = pad_blocks(n)
        counted = per_rank(rank, each if w is None else w * each, a.world)
    if blocks and n.size:  # the pad runs of each row group by position, joined where they touch
        key = pos if grp is None else grp * (int((pos + n).max()) + 1) + pos
        order = np.argsort(key, kind="stable")
        k, m = key[order], n[order]
        head = np.ones(k.size, dtype=bool)
        head[1:] = k[1:] != k[:-1] + m[:-1]
        first = np.flatnonzero(head)
        jb = pad_blocks(np.add.reduceat(m, first))
        joined = float((jb if w is None else w[order][first] * jb).sum())
    if not (n > 1).any():
        return None, counted, joined
    extra = pad_tile_pairs(n)
    return per_rank(rank, extra if w is None else w * extra, a.world), counted, joined


def _group_sums(x: np.ndarray, head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(before, total)``: per element, the sum of ``x`` over the earlier elements of its group
    (groups start where ``head`` holds, ``head[0]`` true) and over its whole group."""
    incl = np.cumsum(x)
    excl = incl - x
    gid = np.cumsum(head) - 1
    first = np.flatnonzero(head)
    last = np.append(first[1:], x.size) - 1
    return excl - excl[first][gid], (incl[last] - excl[first])[gid]


def _tiled_blocks(
    n: np.ndarray, rank: np.ndarray, doc: np.ndarray, key: np.ndarray, w: np.ndarray | None,
    world: int, causal: bool, order: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float, bool] | None:  # fmt: skip
    """``(every [C], own [C], stream, joined)`` blocks of the real runs (stream order: ``n``,
    ``rank``, ``doc`` a document id unique over the row groups, ``key`` the code shifted per
    row group, ``w`` the meta rows of each run or ``None``), by prefix sums in code order
    (``order``: given, or a sort); ``None`` where the runs do not tile their documents or a
    rank's runs are out of code order.

    A query run of ``nq`` sees whole every earlier run of its document (one unmasked call each:
    :func:`full_blocks`, ``ceil(nq / qs)`` query blocks times the key run's key blocks) and
    itself causally (:func:`causal_blocks`); bidirectional, every run of its document whole."""
    if order is None:
        order = np.argsort(key, kind="stable")
    sk, sn, sd, sr = key[order], n[order], doc[order], rank[order]
    if sn.size > 1 and not bool((sk[1:] >= sk[:-1] + sn[:-1]).all()):
        return None  # two real tokens share a code: not a tiling
    same_rank = rank[1:] == rank[:-1]
    if n.size > 1 and not bool(((key[1:] >= key[:-1] + n[:-1]) | ~same_rank).all()):
        return None  # a rank's runs out of code order
    head = np.ones(sn.size, dtype=bool)
    head[1:] = sd[1:] != sd[:-1]
    kb = -(-sn // KV_BLOCK)
    before, total = _group_sums(kb, head)
    own_head = np.ones(n.size, dtype=bool)
    own_head[1:] = ~same_rank | (doc[1:] != doc[:-1])
    own_before, own_total = _group_sums(-(-n // KV_BLOCK), own_head)
    sw = None if w is None else w[order]
    qb_s, qb = -(-sn // query_block(sn)), -(-n // query_block(n))
    if causal:
        every = causal_blocks(sn) + qb_s * before
        own = causal_blocks(n) + qb * own_before
    else:
        every, own = qb_s * total, qb * own_total
    # Ulysses: the runs sorted by position, joined where they touch (where that halves them)
    touch = np.zeros(sn.size, dtype=bool)
    touch[1:] = sk[1:] == sk[:-1] + sn[:-1]  # codes of two documents never touch
    stream_every = every
    joined = bool(sn.size) and 2 * (sn.size - int(touch.sum())) <= sn.size
    if joined:
        first = np.flatnonzero(~touch)
        jn = np.add.reduceat(sn, first)
        jhead = head[first]
        jb, jt = _group_sums(-(-jn // KV_BLOCK), jhead)
        qj = -(-jn // query_block(jn))
        stream_every = causal_blocks(jn) + qj * jb if causal else qj * jt
        sw = None if sw is None else sw[first]
    if w is not None:
        every, own = every * w[order], own * w
        stream_every = stream_every * sw
    return (per_rank(sr, every, world), per_rank(rank, own, world),
            float(stream_every.sum()), joined)  # fmt: skip


def _estimated_blocks(
    runs: RankRuns, w: int, pairs: np.ndarray, local: np.ndarray, window: int | None
) -> tuple[np.ndarray, np.ndarray, float]:
    """:func:`_tiled_blocks` estimated for one row group (a window, or runs that do not tile):
    each rank's query blocks times the key blocks of its mean visible keys per query (``pairs``
    and ``local`` of the group, unweighted); with a window at least two blocks per
    :data:`~cpshard.attention.pieces.TILE`-square tile of the band (the plans cut its border so)."""
    real = runs.real
    c = runs.world
    qb = per_rank(real.rank, -(-real.n // query_block(real.n)), c)
    tokens = np.maximum(per_rank(real.rank, real.n, c), 1)
    every = w * qb * -(-pairs // (tokens * KV_BLOCK))
    own = w * qb * -(-local // (tokens * KV_BLOCK))
    if window is not None:  # the window's border: tiles of at most TILE squared, 2 blocks each
        every = np.maximum(every, w * 2 * pairs // (TILE * TILE))
        own = np.maximum(own, w * 2 * local // (TILE * TILE))
    return every, own, float(every.sum())


def _kernel_blocks(
    a: MetaArrays, causal: bool, window: int | None, pad: np.ndarray, pad_joined: float
) -> KernelBlocks:
    """The :class:`KernelBlocks` of the batch (``pad``: the ranks' :func:`pad_blocks`;
    ``pad_joined``: those of the pad runs joined by position, where Ulysses sorts the stream)."""
    c = a.world
    every_group = a.every_group() if window is None else None
    got = None
    if every_group is not None:  # several row groups at once, in one code space
        q = every_group.real
        docs = max(a.frame.docs.size, 1)
        got = _tiled_blocks(q.n, q.rank, q.doc + every_group.grp * docs,
                            q.code + every_group.shift(0), a.weights[every_group.grp], c,
                            causal)  # fmt: skip
    elif window is None:
        parts = []
        for g, runs in enumerate(a.runs):
            tiling = runs.tiling()
            if tiling is None:
                break
            real = runs.real
            part = _tiled_blocks(real.n, real.rank, real.doc, real.code, None, c, causal,
                                 tiling.order)  # fmt: skip
            if part is None:
                break
            w = int(a.weights[g])
            parts.append((w * part[0], w * part[1], w * part[2], part[3]))
        else:
            got = (np.sum([p[0] for p in parts], axis=0), np.sum([p[1] for p in parts], axis=0),
                   float(sum(p[2] for p in parts)), all(p[3] for p in parts))  # fmt: skip
    exact = got is not None
    if got is None:
        every, own, stream = np.zeros(c, dtype=np.int64), np.zeros(c, dtype=np.int64), 0.0
        for g, runs in enumerate(a.runs):
            seen, mine = _group_pairs(runs, a.frame, causal, window)
            e, o, s = _estimated_blocks(runs, int(a.weights[g]), seen, mine, window)
            every, own, stream = every + e, own + o, stream + s
        got = (every, own, stream, False)
    every, own, stream, joined = got
    stream += pad_joined if joined else float(pad.sum())
    return KernelBlocks(own + pad, every + pad, float(stream), exact)


def _pairs(a: MetaArrays, causal: bool, window: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``([C], [C])``: visible pairs of each rank's queries against every key, and against its
    own keys (weighted by the meta rows each group stands for); closed forms over runs (several
    row groups at once where :meth:`MetaArrays.every_group` applies, else per group: prefix sums
    in code order where :meth:`~cpshard.attention.visibility.RankRuns.tiled_sums` applies,
    binary searches otherwise)."""
    every = a.every_group()
    if every is not None:  # several row groups, all at once
        return every.pairs(a.weights, causal, window)
    c = a.world
    pairs = np.zeros(c, dtype=np.int64)
    local = np.zeros(c, dtype=np.int64)
    for g, runs in enumerate(a.runs):
        w = int(a.weights[g])
        seen, mine = _group_pairs(runs, a.frame, causal, window)
        pairs += w * (seen + runs.pad_tokens)  # a pad sees itself, on its own rank
        local += w * (mine + runs.pad_tokens)
    return pairs, local


def _group_pairs(
    runs: RankRuns, frame: Frame, causal: bool, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """``([C], [C])``: one row group's real pairs of :func:`_pairs`, unweighted, pads left out."""
    tiled = runs.tiled_sums(causal) if window is None else None
    if tiled is not None:
        return tiled.pairs, tiled.local
    return _searched_pairs(runs, frame, causal, window)


def _searched_pairs(
    runs: RankRuns, frame: Frame, causal: bool, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """``([C], [C])``: one row group's real pairs of :func:`_pairs` by binary searches
    (:func:`~cpshard.attention.visibility.visible_pairs`), for any stream and window."""
    c = runs.world
    ordered = runs.by_code()  # the same runs, sorted: per-rank sums are order-free
    seen = visible_pairs(ordered, runs.keys(), frame, causal, window)
    pairs = per_rank(ordered.rank, seen, c)
    if runs.blocked:  # every rank's own keys at once, in its rank block
        real = runs.real
        mine = visible_pairs(real, runs.block_keys(), frame, causal, window, runs.shift())
        return pairs, per_rank(real.rank, mine, c)
    local = np.zeros(c, dtype=np.int64)
    for r in range(c):
        mine = visible_pairs(runs.of(r), runs.keys(r), frame, causal, window)
        local[r] = int(mine.sum())
    return pairs, local


def plan_facts(
    meta: TokenMeta, causal: bool = True, window: int | None = None, *, blocks: bool = False
) -> PlanFacts:
    """The :class:`PlanFacts` of ``meta``'s batch for one mask (cached on the meta).

    Args:
        meta: Token meta of a sharded batch (any rank's: the facts are global).
        causal: Causal masking.
        window: Sliding window or ``None``.
        blocks: Also count the kernel blocks (:attr:`PlanFacts.blocks`; what a model with a
            finite :attr:`CostModel.block_rate` charges, :meth:`CostModel.needs_blocks`): a
            few dozen more numpy calls over the runs, skipped where no block is charged.

    Returns:
        The facts; cost ``O(C R log R)`` host work for ``R`` runs of the stream
        (:mod:`cpshard.attention.visibility`), whatever the number of tokens.
    """
    key = f"plan_facts|{causal}|{window}"
    hit = meta.plan_cache.get(key)
    if isinstance(hit, PlanFacts) and (hit.blocks is not None or not blocks):
        return hit
    a = meta_arrays(meta)
    if isinstance(hit, PlanFacts):  # the facts without their blocks: count those alone
        _, pad, joined = _pads(a, True)
        assert pad is not None
        facts = dataclasses.replace(hit, blocks=_kernel_blocks(a, causal, window, pad, joined))
    else:
        pairs, local = _pairs(a, causal, window)
        recv, send = exchange_sums(a, causal, window)
        pad_pairs, pad, joined = _pads(a, blocks)
        counted = None if pad is None else _kernel_blocks(a, causal, window, pad, joined)
        facts = PlanFacts(
            a.world, a.local_len, int(a.weights.sum()), pairs, local, recv, send, pad_pairs,
            counted,
        )  # fmt: skip
    meta.plan_cache[key] = facts
    return facts


def _slot_and_acc(shape: CallShape) -> tuple[float, int]:
    """Elements of one K/V slot (all rows), and the itemsize of the backward's dK/dV (fp32, or
    the input's when wider)."""
    return 2.0 * shape.kv_heads * shape.head_dim * shape.batch, max(4, shape.itemsize)


def _ulysses_elements(shape: CallShape, c: int, n: int) -> tuple[float, float]:
    """Elements one rank's Ulysses all-to-alls move: q, k, v to heads (and grad-out, dq, dk, dv
    back in the backward), and the output back to tokens, ``(C-1)/C`` of the local tensors."""
    heads = (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim * shape.batch * (c - 1) / c * n
    out = shape.q_heads * shape.head_dim * shape.batch * (c - 1) / c * n
    return heads, out


def method_costs(facts: PlanFacts, shape: CallShape, model: CostModel) -> dict[str, float]:
    """Modelled seconds of one layer's forward + backward attention, per method (max over ranks).

    Args:
        facts: The batch's :class:`PlanFacts` for the call's mask.
        shape: The call.
        model: Rates.

    Returns:
        ``{method name: seconds}`` for every method of the registry.
    """
    c, n = facts.world, facts.local_len
    rows = shape.batch / facts.meta_rows  # a one-row meta serves every batch row
    flop = 4.0 * shape.head_dim * shape.q_heads * rows
    pads = 0 if facts.pad_pairs is None else facts.pad_pairs  # pad diagonals: on the own keys
    fwd = (facts.pairs + pads) * flop / model.compute_rate  # [C] seconds
    fwd_local = (facts.local_pairs + pads) * flop / model.compute_rate
    bwd, bwd_local = fwd * BACKWARD_FACTOR, fwd_local * BACKWARD_FACTOR
    slot, acc = _slot_and_acc(shape)
    bw, lat, f = model.link_bandwidth, model.latency, model.overlap

    def hide(comm: np.ndarray | float, work: np.ndarray) -> np.ndarray:
        """``comm`` of which ``f`` hides behind ``work``: ``comm + work - min(f * comm, work)``
        (``max(comm, work)`` at ``f = 1``)."""
        out: np.ndarray = np.maximum(f * comm, work) + (1.0 - f) * comm
        return out

    # Kernel blocks (CostModel.block_rate): per query head and row, forward and backward,
    # unhidden; [C] for the methods that cut at the rank blocks, Ulysses's 1/C of the stream's.
    per_block = rows * shape.q_heads * (1.0 + BACKWARD_FACTOR) / model.block_rate
    blocks = facts.blocks
    block_t = 0.0 if blocks is None else blocks.every * per_block

    def overlapped(moved_slots: np.ndarray | float) -> float:
        """The step with ``moved_slots`` K/V slots in or out per rank (the larger) forward, as
        many dK/dV backward, each exchange hidden behind the own keys' compute."""
        moved = moved_slots * slot
        t_f = hide(moved * shape.itemsize / bw + lat, fwd_local) + (fwd - fwd_local)
        t_b = hide(moved * acc / bw + lat, bwd_local) + (bwd - bwd_local)
        return float((t_f + t_b + block_t).max())

    # Passes over the queries: own keys then the remote ones (all_gather, selective: 2), one per
    # ring step (C), one over the whole stream with 1/C of the heads (ulysses: 1); the backward
    # makes as many, each BACKWARD_FACTOR times the forward's work.
    one_pass = n * shape.batch * shape.q_heads * shape.head_dim / model.pass_rate
    one_pass *= 1.0 + BACKWARD_FACTOR
    costs: dict[str, float] = {}
    if c == 1:
        base = float((fwd + bwd + block_t).max()) + one_pass
        return {name: base for name in METHODS}
    # all_gather: every rank every other block; the gathered K/V and dK/dV buffers (C * L slots)
    # cost their own memory traffic (CostModel.gather_bandwidth)
    gathered = c * n * slot * (shape.itemsize + acc) / model.gather_bandwidth
    costs["all_gather"] = overlapped(float((c - 1) * n)) + gathered
    # Ring: C lock-stepped steps; step s computes one block while the next one travels, so
    # every step costs max(hop, its compute) except the last (nothing left to send); the
    # backward's hops carry K/V and the fp32 dK/dV, and the accumulators take one more hop home.
    remote_f = (fwd - fwd_local) / (c - 1)
    remote_b = (bwd - bwd_local) / (c - 1)
    hop_f = n * slot * shape.itemsize / bw + lat
    hop_b = n * slot * (shape.itemsize + acc) / bw + lat
    t_ring = (
        hide(hop_f, fwd_local) + (c - 2) * hide(hop_f, remote_f) + remote_f
        + hide(hop_b, bwd_local) + (c - 2) * hide(hop_b, remote_b) + remote_b
        + n * slot * acc / bw + lat
    )  # fmt: skip
    costs["ring"] = float((t_ring + block_t).max())
    heads, out = _ulysses_elements(shape, c, n)
    uly_bytes = (heads + out) * shape.itemsize + (out * shape.itemsize + heads * acc)
    uly_comm = uly_bytes / bw + uly_bytes / model.all_to_all_bandwidth
    total = float(facts.pairs.sum() + np.sum(pads)) * flop / model.compute_rate
    total *= 1 + BACKWARD_FACTOR
    if blocks is not None:
        total += blocks.stream * per_block
    costs["ulysses"] = uly_comm + total / c + 4 * lat
    costs["selective"] = overlapped(
        np.maximum(facts.recv_slots.astype(np.float64), facts.send_slots.astype(np.float64))
    )
    passes = {"all_gather": 2.0, "selective": 2.0, "ring": float(c), "ulysses": 1.0}
    return {name: costs[name] + passes[name] * one_pass for name in METHODS}


def method_bytes(facts: PlanFacts, shape: CallShape) -> dict[str, np.ndarray]:
    """Bytes one layer's forward + backward moves per method and rank: what the rank sends or
    receives (the larger), as :func:`method_costs` charges the link.

    Args:
        facts: The batch's :class:`PlanFacts` for the call's mask.
        shape: The call.

    Returns:
        ``{method name: [C] float64 bytes}`` for every method of the registry (0 at ``C = 1``).
    """
    c, n = facts.world, facts.local_len
    if c == 1:
        return {name: np.zeros(1) for name in METHODS}
    slot, acc = _slot_and_acc(shape)
    both = shape.itemsize + acc  # forward K/V in the input dtype, backward dK/dV in fp32
    heads, out = _ulysses_elements(shape, c, n)
    moved = {
        "all_gather": (c - 1) * n * slot * both,
        "ring": (c - 1) * n * slot * (shape.itemsize + both) + n * slot * acc,
        "ulysses": (heads + out) * shape.itemsize + out * shape.itemsize + heads * acc,
    }
    per_rank = {name: np.full(c, float(v)) for name, v in moved.items()}
    sel = np.maximum(facts.recv_slots, facts.send_slots).astype(np.float64)
    per_rank["selective"] = sel * slot * both
    return {name: per_rank[name] for name in METHODS}


def wire_bytes(facts: PlanFacts, shape: CallShape) -> dict[str, float]:
    """Bytes one layer's forward + backward puts on the wire per method, all ranks together (what
    every rank sends; a rank's receives are another's sends).

    Args:
        facts: The batch's :class:`PlanFacts` for the call's mask.
        shape: The call.

    Returns:
        ``{method name: bytes}`` for every method of the registry.
    """
    return _wire_of(method_bytes(facts, shape), facts, shape)


def _wire_of(
    per_rank: dict[str, np.ndarray], facts: PlanFacts, shape: CallShape
) -> dict[str, float]:
    """:func:`wire_bytes` from :func:`method_bytes`'s answer ``per_rank``."""
    out = {name: float(v.sum()) for name, v in per_rank.items()}
    if facts.world > 1:  # selective: every slot a rank receives is sent once, its grad once back
        slot, acc = _slot_and_acc(shape)
        out["selective"] = float(facts.recv_slots.sum()) * slot * (shape.itemsize + acc)
    return out


def choose_method(
    facts: PlanFacts, shape: CallShape, model: CostModel, candidates: tuple[str, ...]
) -> tuple[str, dict[str, float]]:
    """The cheapest of ``candidates``, and every method's cost.

    Ties (within :data:`TIE_RTOL`) go to the candidate that moves the fewest bytes
    (:func:`method_bytes` of the busiest rank, then :func:`wire_bytes`; e.g. ``selective`` over
    ``all_gather`` when both exchanges hide behind the compute: bytes the model hides still cost
    memory traffic and link time), then to the first in registry order.

    Raises:
        ValueError: no candidate.
    """
    if not candidates:
        raise ValueError("attention='auto' has no method to choose from for this call")
    costs = method_costs(facts, shape, model)
    least = min(costs[m] for m in candidates)
    tied = [m for m in candidates if costs[m] <= least * (1.0 + TIE_RTOL)]
    if len(tied) == 1:  # no tie to break: the bytes would not change the answer
        return tied[0], costs
    per_rank = method_bytes(facts, shape)
    busiest = {m: float(per_rank[m].max()) for m in tied}
    wire = _wire_of(per_rank, facts, shape)
    best = min(tied, key=lambda m: (busiest[m], wire[m], list(METHODS).index(m)))
    return best, costs
