"""Flash varlen attention over packed document runs: kept for the benchmarks, no engine caller.

CP attention runs packed documents through the per-batch plan's blocks
(:func:`cpshard.attention.kernels.block_attention`); these kernels attend packed query runs to
their key runs (``cu_seqlens`` boundaries) in one call instead, and ``benchmarks/bench_gpu.py``
measures them beside the public path. They moved here from ``cpshard.attention.kernels`` and
``cpshard.attention.cuda_kernels`` (issue 20: about 375 lines with no caller in ``src/``); the
tests import them from here (``tests/unit/test_attention_varlen.py``, ``tests/gpu``).

:func:`varlen_attention` / :func:`varlen_attention_backward` go through flash varlen on CUDA
and an exact per-run loop of :func:`~cpshard.attention.kernels.block_attention` elsewhere. Causal
runs are aligned **bottom-right**: query ``i`` of a run with ``Lq`` queries and ``Lk`` keys sees
keys ``j <= i + Lk - Lq`` (the queries are the *last* ``Lq`` positions of the keys' span, which is
what a rank holding the tail of a document needs). A query that sees no key gets ``out = 0`` and
``lse = -inf``, as in :func:`~cpshard.attention.kernels.block_attention`.

The op: ``aten._flash_attention_forward`` / ``_flash_attention_backward`` with ``cum_seq_q`` /
``cum_seq_k`` (``int32 [n + 1]``), q/k/v as ``[T, H, D]``, LSE ``[H, Tq]`` fp32 (unpadded, checked
in the sources; see :mod:`cpshard.attention.cuda_kernels` for the conventions the fused ops share).
With ``max_q == 1`` and GQA flash varlen reshapes ``q`` to ``[n_runs, ...]``, which fails when a
run has no query, so ``max_q`` is passed as at least 2, a valid bound.

Uses private helpers of :mod:`cpshard.attention.kernels` and :mod:`cpshard.attention.cuda_kernels`
(a benchmark's privilege: they are not public API).
"""

from __future__ import annotations

import torch

from cpshard import _compat
from cpshard.attention import cuda_kernels as ck
from cpshard.attention.cuda_kernels import _groups, _lse_rows, _pad_head, padded_head_dim
from cpshard.attention.kernels import (
    KernelBackend,
    _warn_fallback,
    block_attention,
    block_attention_backward,
)
from cpshard.attention.merge import accumulation_dtype, merge_into

__all__ = [
    "flash_varlen_backward",
    "flash_varlen_forward",
    "varlen_attention",
    "varlen_attention_backward",
    "varlen_max_q_bound",
    "varlen_visible_keys",
]


# --- flash varlen ----------------------------------------------------------------------------


def varlen_max_q_bound(max_q: int) -> int:
    """The ``max_q`` handed to flash varlen: the caller's bound, at least 2.

    With ``max_q == 1`` and ``Hq > Hkv`` (and no window or dropout), torch's flash varlen forward
    (``mha_varlen_fwd``, "seqlenq_ngroups_swapped") reshapes ``q [Tq, Hq, D]`` to
    ``[n_runs, Hkv, G, D]``, which raises when a run has no query (``Tq < n_runs``). ``max_q``
    only sizes the kernel's grid, so 2 is an equally valid bound; causal stays exact because a
    1-query run sees all its keys under bottom-right alignment either way.
    """
    return max(max_q, 2)


def varlen_visible_keys(
    cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, *, causal: bool
) -> torch.Tensor:
    """Number of keys each packed query sees, computed on the device without a host sync.

    Causal alignment is bottom-right per run: query ``i`` of a run with ``Lq`` queries and ``Lk``
    keys sees keys ``0 .. i + Lk - Lq`` (clamped to ``[0, Lk]``).

    Args:
        cu_q: ``int32 [n + 1]`` query run boundaries, ``cu_q[-1] == total_q``.
        cu_k: ``int32 [n + 1]`` key run boundaries.
        total_q: Number of packed queries.
        causal: Bottom-right causal per run.

    Returns:
        ``int64 [total_q]``.
    """
    cq, ck = cu_q.long(), cu_k.long()
    len_q = cq[1:] - cq[:-1]
    len_k = ck[1:] - ck[:-1]
    run = torch.repeat_interleave(
        torch.arange(len_q.numel(), device=cu_q.device), len_q, output_size=total_q
    )
    lk = len_k[run]
    if not causal:
        return lk
    local = torch.arange(total_q, device=cu_q.device) - cq[run]
    return (local + lk - len_q[run] + 1).clamp(min=0).minimum(lk)


def flash_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash varlen attention over packed runs, with its LSE.

    Args:
        q: ``[Tq, Hq, D]`` fp16/bf16 packed queries.
        k: ``[Tk, Hkv, D]`` packed keys.
        v: ``[Tk, Hkv, D]`` packed values.
        cu_q: ``int32 [n + 1]`` query run boundaries on q's device.
        cu_k: ``int32 [n + 1]`` key run boundaries.
        max_q: Longest query run.
        max_k: Longest key run.
        causal: Bottom-right causal per run.
        scale: Score scale.

    Returns:
        ``(out [Tq, Hq, D] in q's dtype, lse [Hq, Tq] fp32)``; queries with no visible key have
        ``out = 0`` and ``lse = -inf``.
    """
    _groups(q, k, 1)
    d = q.shape[-1]
    dp = padded_head_dim(d)
    res = _compat.flash_varlen_attention(
        _pad_head(q, dp),
        _pad_head(k, dp),
        _pad_head(v, dp),
        cu_q,
        cu_k,
        varlen_max_q_bound(max_q),
        max_k,
        causal=causal,
        scale=scale,
    )
    # The run offsets index an unpadded [H, Tq] LSE: any other length is another layout.
    lse = _lse_rows(
        res[1], (q.shape[1],), q.shape[0], "_flash_attention_forward (varlen)", exact=True
    ).float()
    out = res[0][..., :d]
    # flash reports lse = +inf for a query with no key; the contract is out = 0, lse = -inf.
    empty = varlen_visible_keys(cu_q, cu_k, q.shape[0], causal=causal) == 0
    lse = lse.masked_fill(empty.unsqueeze(0), float("-inf"))
    out = out.masked_fill(empty[:, None, None], 0.0)
    return out, lse


def flash_varlen_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`flash_varlen_forward` given the merged ``out`` / ``lse``.

    ``lse`` may be ``-inf`` for queries that see no key anywhere; it is replaced by 0 (every
    score of such a query is masked, so it contributes nothing).

    Returns:
        ``(dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])`` in q's dtype.
    """
    _groups(q, k, 1)
    d = q.shape[-1]
    dp = padded_head_dim(d)
    lse = lse.float()
    lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).contiguous()
    dq, dk, dv = _compat.flash_varlen_attention_backward(
        _pad_head(grad_out.to(q.dtype), dp),
        _pad_head(q, dp),
        _pad_head(k, dp),
        _pad_head(v, dp),
        _pad_head(out.to(q.dtype), dp),
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        causal=causal,
        scale=scale,
    )
    # Queries that see no key, and keys of runs without queries, get exact zeros (flash may
    # skip writing them for empty runs).
    dq = dq[..., :d].masked_fill(
        (varlen_visible_keys(cu_q, cu_k, q.shape[0], causal=causal) == 0)[:, None, None], 0.0
    )
    unseen = (varlen_visible_keys(cu_k, cu_q, k.shape[0], causal=False) == 0)[:, None, None]
    return dq, dk[..., :d].masked_fill(unseen, 0.0), dv[..., :d].masked_fill(unseen, 0.0)


# --- packed document runs (varlen) -----------------------------------------------------------


def _check_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
) -> None:
    """Shape/dtype checks (host metadata only); on CPU also the boundary values."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "varlen attention takes q [Tq, Hq, D] and k, v [Tk, Hkv, D] with the same D, got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    ck._groups(q, k, 1)
    for name, cu in (("cu_q", cu_q), ("cu_k", cu_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device:
            raise ValueError(
                f"{name} must be a 1-D int32 tensor on q's device ({q.device}), got "
                f"{cu.dtype} {tuple(cu.shape)} on {cu.device}"
            )
    if cu_q.numel() != cu_k.numel() or cu_q.numel() < 1:
        raise ValueError(
            f"cu_q and cu_k must both have n + 1 >= 1 entries (n runs), got {cu_q.numel()} "
            f"and {cu_k.numel()}"
        )
    if q.device.type != "cpu":
        return  # reading the boundaries would sync with the device: the caller vouches for them
    for name, cu, total, mx in (
        ("cu_q", cu_q, q.shape[0], max_q),
        ("cu_k", cu_k, k.shape[0], max_k),
    ):
        lens = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lens < 0).any()):
            raise ValueError(
                f"{name} must rise from 0 to the packed length {total} without decreasing, "
                f"got {cu.tolist()}"
            )
        if lens.numel() and int(lens.max()) > mx:
            raise ValueError(
                f"max_{name[-1]}={mx} is smaller than the longest run ({int(lens.max())}); "
                "pass the longest run length"
            )


def _run_pieces(lq: int, lk: int, causal: bool) -> list[tuple[int, int, int, int, bool]]:
    """Cut one run into kernel calls: ``(q0, q1, k0, k1, is_causal)`` (square when causal).

    Bottom-right causal: query ``i`` sees keys ``j <= i + lk - lq``. With ``lk >= lq`` the first
    ``lk - lq`` keys are visible to every query and the last ``lq`` form a square causal block;
    with ``lk < lq`` the first ``lq - lk`` queries see nothing and the rest form a square.
    """
    if lq == 0 or lk == 0:
        return []
    if not causal:
        return [(0, lq, 0, lk, False)]
    off = lk - lq
    if off < 0:
        return [(-off, lq, 0, lk, True)]
    pieces = [(0, lq, 0, off, False)] if off else []
    return [*pieces, (0, lq, off, lk, True)]


def _fused_varlen_ok(q: torch.Tensor, backend: KernelBackend) -> bool:
    """Whether flash varlen runs this call; warns once per reason when it does not on CUDA."""
    if q.device.type != "cuda" or backend not in ("auto", "cuda_flash"):
        return False
    blocker = ck._flash_blocker(q.dtype, q.shape[-1], torch.cuda.get_device_capability(q.device))
    if blocker and backend == "cuda_flash":
        raise ValueError(
            f"attention backend 'cuda_flash' cannot run this varlen call: {blocker}; "
            "use backend='auto' or 'math'"
        )
    if blocker:
        _warn_fallback(
            f"varlen attention on CUDA: {blocker}, so no fused varlen kernel; running one kernel "
            "call per document run (a host sync per call): use fp16/bf16 for flash varlen"
        )
    return not blocker


def _as_block(x: torch.Tensor) -> torch.Tensor:
    """``[L, H, D]`` -> ``[1, H, L, D]`` view."""
    return x.transpose(0, 1).unsqueeze(0)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    causal: bool,
    scale: float,
    backend: KernelBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed query runs against their key runs, with the log-sum-exp.

    Run ``r`` is queries ``cu_q[r]:cu_q[r+1]`` against keys ``cu_k[r]:cu_k[r+1]``; runs never
    see each other. Causal runs are aligned bottom-right (see the module docstring). On CUDA with
    fp16/bf16 this is one flash varlen call without a host sync; otherwise (CPU, fp32/fp64 on
    CUDA) an exact loop of :func:`block_attention` calls per run. On CPU the boundaries are
    checked; on CUDA they are not read (that would sync): they must rise from 0 to ``Tq``/``Tk``.

    Args:
        q: ``[Tq, Hq, D]`` packed queries.
        k: ``[Tk, Hkv, D]`` packed keys, ``Hq % Hkv == 0`` (not repeated).
        v: ``[Tk, Hkv, D]`` packed values.
        cu_q: ``int32 [n + 1]`` query run boundaries on q's device.
        cu_k: ``int32 [n + 1]`` key run boundaries.
        max_q: Longest query run (a bound; flash sizes its grid by it).
        max_k: Longest key run.
        causal: Bottom-right causal within each run.
        scale: Score scale.
        backend: As for :func:`block_attention` (``"cuda_flash"`` forces flash varlen).

    Returns:
        ``(out [Tq, Hq, D] in q's dtype, lse [Hq, Tq])``, natural-log LSE in the accumulation
        dtype (fp32; fp64 for fp64 inputs); queries with no visible key have ``out = 0`` and
        ``lse = -inf``.
    """
    _check_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    if q.shape[0] and k.shape[0] and _fused_varlen_ok(q, backend):
        return flash_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale)
    acc = accumulation_dtype(q.dtype)
    tq, hq, d = q.shape
    out = torch.zeros((1, hq, tq, d), dtype=acc, device=q.device)
    lse = torch.full((1, hq, tq), float("-inf"), dtype=acc, device=q.device)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    qb, kb, vb = _as_block(q), _as_block(k), _as_block(v)
    for r in range(len(bq) - 1):
        qa, ka = bq[r], bk[r]
        for q0, q1, k0, k1, c in _run_pieces(bq[r + 1] - qa, bk[r + 1] - ka, causal):
            o, l_ = block_attention(
                qb[:, :, qa + q0 : qa + q1],
                kb[:, :, ka + k0 : ka + k1],
                vb[:, :, ka + k0 : ka + k1],
                mask=None,
                is_causal=c,
                scale=scale,
                backend=backend,
            )
            merge_into(out[:, :, qa + q0 : qa + q1], lse[:, :, qa + q0 : qa + q1], o, l_)
    return out[0].transpose(0, 1).to(q.dtype), lse[0]


def varlen_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    causal: bool,
    scale: float,
    backend: KernelBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`varlen_attention` given the merged output and LSE.

    As with :func:`block_attention_backward`, ``out``/``lse`` may be merged over more key sets
    than these runs (e.g. other ranks' keys), so the returned gradients add up exactly.

    Args:
        grad_out: ``[Tq, Hq, D]`` upstream gradient of the merged output.
        q: ``[Tq, Hq, D]`` packed queries.
        k: ``[Tk, Hkv, D]`` packed keys.
        v: ``[Tk, Hkv, D]`` packed values.
        out: ``[Tq, Hq, D]`` merged output.
        lse: ``[Hq, Tq]`` merged LSE (``-inf`` only for queries that see no key anywhere).
        cu_q: As in the forward.
        cu_k: As in the forward.
        max_q: As in the forward.
        max_k: As in the forward.
        causal: As in the forward.
        scale: Score scale.
        backend: As in the forward.

    Returns:
        ``(dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])``: in q's dtype from flash varlen,
        in the accumulation dtype from the per-run loop; callers add them into
        accumulation-dtype buffers.
    """
    _check_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    if q.shape[0] and k.shape[0] and _fused_varlen_ok(q, backend):
        return flash_varlen_backward(
            grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale
        )
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    qb, kb, vb = _as_block(q), _as_block(k), _as_block(v)
    gb, ob = _as_block(grad_out.to(q.dtype)), _as_block(out.to(q.dtype))
    lb = lse.unsqueeze(0)
    for r in range(len(bq) - 1):
        qa, ka = bq[r], bk[r]
        for q0, q1, k0, k1, c in _run_pieces(bq[r + 1] - qa, bk[r + 1] - ka, causal):
            qs, ks = slice(qa + q0, qa + q1), slice(ka + k0, ka + k1)
            gq, gk, gv = block_attention_backward(
                gb[:, :, qs],
                qb[:, :, qs],
                kb[:, :, ks],
                vb[:, :, ks],
                ob[:, :, qs],
                lb[:, :, qs],
                mask=None,
                is_causal=c,
                scale=scale,
                backend=backend,
            )
            dq[qs] += gq[0].transpose(0, 1)
            dk[ks] += gk[0].transpose(0, 1)
            dv[ks] += gv[0].transpose(0, 1)
    return dq, dk, dv
