"""The only module of cpshard that calls ``torch.distributed``.

Owns every collective, the group/rank lookups of a mesh and process-group creation: every
function of ``torch.distributed`` that cpshard calls is called from here, and none of them is
private (``TorchDispatchMode``, which torch keeps in a private module, comes through
:mod:`cpshard._compat`).

Every collective here takes its process group explicitly and makes its tensors contiguous at the
boundary, in the forward and in the backward: on gloo (torch 2.13) a non-contiguous tensor handed to
a collective can silently produce wrong values (``dist.scatter``) or wrong gradients (the autograd
all-gather of ``torch.distributed.nn``), and the CPU SDPA backward returns exactly such gradients.

Placement: a collective runs on a device its group serves. A group made with the plain
``"nccl"`` backend serves CUDA tensors only (torch 2.11: "No backend type associated with device
type cpu" for a CPU tensor), a gloo group serves CPU tensors (and moves CUDA tensors only in some
collectives). Every collective here therefore looks up where its tensors must travel
(:func:`transport_device_type`, from the group's backend) and, when the tensors live elsewhere,
copies its inputs to :func:`group_device`, runs there, and copies the results back into tensors on
the caller's device. So callers never place a tensor for the group: the small CPU tensors of the
batch fingerprint, the verb checks, the rank-map gather and ``sync_grads``' flags go to the GPU of
an NCCL group, and CUDA tensors of several CP ranks sharing one GPU (whose group is gloo, since
NCCL refuses two ranks on one GPU) go through host memory ("host staging"). The library itself
reads no environment variable.

The CPU tests check this on gloo: ``tests/_nccl_like.py`` makes every group look NCCL-only to this
module (``dist`` answers ``"nccl"`` and refuses every tensor that :func:`_move` did not put on the
group's device), and the forced host-staging tests make :func:`_transport` copy CPU tensors through
fresh host buffers.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from cpshard._compat import TorchDispatchMode, flatten_mesh

__all__ = [
    "CP_GRID_DIMS",
    "CommRecorder",
    "GradMode",
    "all_gather_dim0",
    "all_gather_fixed",
    "all_reduce_sum_coalesced_",
    "all_reduce_sum_mesh_",
    "cp_group",
    "cp_rank_and_size",
    "grid_groups",
    "group_device",
    "group_ranks",
    "mesh_contains_this_rank",
    "split_cp_mesh",
    "transport_device_type",
    "validate_cp_mesh",
]


# Backends that serve one accelerator's tensors only (a group made with this name alone).
_ACCELERATOR_OF = (("nccl", "cuda"), ("xccl", "xpu"), ("hccl", "hpu"))


def _served(backend: str) -> dict[str, str] | None:
    """Device type -> backend name of a group's backend string; ``None``: serves every device.

    ``"gloo"`` serves the CPU, ``"nccl"`` CUDA only, ``"cpu:gloo,cuda:nccl"`` both; an unknown
    single name (``"mpi"``, ``"ucc"``, ...) is taken to serve whatever it is given.
    """
    name = backend.lower()
    if ":" in name:
        return dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    if name == "gloo":
        return {"cpu": "gloo"}
    for backend_name, device_type in _ACCELERATOR_OF:
        if name == backend_name:
            return {device_type: name}
    return None


def _home_type(served: dict[str, str]) -> str:
    """The device type a group's collectives run on when a tensor's own device is not served:
    its accelerator served by a non-gloo backend, else the CPU."""
    for device_type, name in served.items():
        if device_type != "cpu" and name != "gloo":
            return device_type
    return "cpu"


def transport_device_type(backend: str, device_type: str) -> str | None:
    """Where a collective on ``device_type`` tensors runs in a group of ``backend``.

    Args:
        backend: The group's backend string, as ``dist.get_backend`` reports it: one name for
            every device (``"gloo"``, ``"nccl"``) or per device (``"cpu:gloo,cuda:nccl"``).
        device_type: The tensors' device type (``"cpu"``, ``"cuda"``, ...).

    Returns:
        ``None`` when the group serves the tensors where they are (CPU tensors on a CPU backend,
        accelerator tensors on a non-gloo backend of their device); otherwise the device type to
        copy them to: the CPU for CUDA tensors on gloo (host staging), ``"cuda"`` for CPU tensors
        on an NCCL-only group.
    """
    served = _served(backend)
    if served is None:
        return None
    name = served.get(device_type)
    if name is not None and (device_type == "cpu" or name != "gloo"):
        return None
    home = _home_type(served)
    return None if home == device_type else home


def group_device(group: ProcessGroup) -> torch.device:
    """The device a group's collectives take tensors on when a tensor's own is not served.

    ``cuda`` (the current CUDA device) for an NCCL-only group, ``cpu`` for gloo (and for groups
    with a CPU backend beside their accelerator one).
    """
    served = _served(str(dist.get_backend(group)))
    return torch.device("cpu" if served is None else _home_type(served))


def _transport(t: torch.Tensor, group: ProcessGroup) -> torch.device | None:
    """The device a collective on ``t`` must run on, or ``None`` to run on ``t`` itself."""
    kind = transport_device_type(str(dist.get_backend(group)), t.device.type)
    return None if kind is None else torch.device(kind)


def _move(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous copy of ``x`` on ``device`` (always a new buffer, also on the same device)."""
    return x.to(device, copy=True, memory_format=torch.contiguous_format)


GradMode = Literal["sum", "replicated"]


CP_GRID_DIMS = ("cp_outer", "cp_inner")
"""The dim names of a 2-D CP mesh (``R x U``): ``cp_inner`` groups of ``U`` consecutive CP ranks run
Ulysses among themselves, ``cp_outer`` groups (one rank of each inner group) run the outer
method (:mod:`cpshard.attention.hybrid`)."""


def validate_cp_mesh(cp_mesh: object, *, grid: bool = False) -> DeviceMesh | None:
    """Check that ``cp_mesh`` is ``None`` or a 1-D ``DeviceMesh`` (with ``grid``: or a 2-D one).

    Args:
        cp_mesh: The caller's CP mesh.
        grid: Also accept a 2-D CP mesh whose dims are named :data:`CP_GRID_DIMS`
            (``("cp_outer", "cp_inner")``): Ulysses inside ``cp_inner``, the attention method
            across ``cp_outer`` (the prepare entry points and ``cp_attention_context``).

    Returns:
        The mesh, or ``None``.

    Raises:
        TypeError: ``cp_mesh`` is neither ``None`` nor a ``DeviceMesh``.
        ValueError: the mesh is not 1-D (with ``grid``: nor 2-D with the dims named
            :data:`CP_GRID_DIMS`).
    """
    if cp_mesh is None:
        return None
    if not isinstance(cp_mesh, DeviceMesh):
        raise TypeError(
            f"cp_mesh must be a 1-D torch DeviceMesh or None, got {type(cp_mesh).__name__}; "
            "build one with init_device_mesh(device, (cp,), mesh_dim_names=('cp',))"
        )
    if grid and cp_mesh.ndim == 2 and tuple(cp_mesh.mesh_dim_names or ()) == CP_GRID_DIMS:
        return cp_mesh
    if cp_mesh.ndim != 1:
        also = (
            f" or a 2-D CP mesh with dims {CP_GRID_DIMS} (Ulysses inside cp_inner, the "
            "attention method across cp_outer)"
            if grid
            else ""
        )
        fix = "pass the sub-mesh, e.g. mesh['cp']"
        if tuple(cp_mesh.mesh_dim_names or ()) == CP_GRID_DIMS:
            fix = "for a 2-D CP mesh pass the sharder's cp_mesh (its flattening)"
        raise ValueError(
            f"cp_mesh must be 1-D (the CP group alone){also}, got a {cp_mesh.ndim}-D mesh "
            f"with dims {cp_mesh.mesh_dim_names}; {fix}"
        )
    return cp_mesh


def split_cp_mesh(cp_mesh: DeviceMesh | None) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """``(flat, grid)`` of a validated CP mesh.

    A 1-D mesh is its own flat mesh, with no grid. A 2-D ``("cp_outer", "cp_inner")`` mesh gives
    its flattened 1-D mesh (row-major: CP rank ``o * U + i`` at ``(o, i)``; made once and cached
    by torch on the root mesh) and itself as the grid.
    """
    if cp_mesh is None or cp_mesh.ndim == 1:
        return cp_mesh, None
    flat: DeviceMesh = flatten_mesh(cp_mesh)
    return flat, cp_mesh


def grid_groups(grid: DeviceMesh) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """``(inner, outer)`` process groups of a 2-D CP mesh (``None`` for a dim of size 1)."""
    inner, outer = (
        grid.get_group(name) if grid.size(dim) > 1 else None
        for dim, name in ((1, CP_GRID_DIMS[1]), (0, CP_GRID_DIMS[0]))
    )
    return inner, outer


def cp_group(cp_mesh: DeviceMesh | None) -> ProcessGroup | None:
    """Process group of a 1-D CP mesh, or ``None`` without CP."""
    if cp_mesh is None or cp_mesh.size() <= 1:
        return None
    return cp_mesh.get_group()


def cp_rank_and_size(cp_mesh: DeviceMesh | None) -> tuple[int, int]:
    """``(rank, world_size)`` inside the CP group; ``(0, 1)`` without a mesh."""
    if cp_mesh is None:
        return 0, 1
    return cp_mesh.get_local_rank(), cp_mesh.size()


_Into = Callable[[torch.Tensor, torch.Tensor, ProcessGroup], Any]


def _into(direct: _Into, out: torch.Tensor, x: torch.Tensor, group: ProcessGroup) -> None:
    """``direct(out, x, group)``, through buffers on the group's device when it does not serve
    ``x``'s device (``out`` is on ``x``'s device)."""
    device = _transport(x, group)
    if device is None:
        direct(out, x, group)
        return
    moved = _move(x, device)
    moved_out = moved.new_empty(out.shape, dtype=out.dtype)
    direct(moved_out, moved, group)
    out.copy_(moved_out)


def _all_gather_into(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup) -> None:
    _into(_all_gather_into_direct, out, x, group)


def _reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup) -> None:
    _into(_reduce_scatter_into_direct, out, x, group)


def _all_to_all_direct(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup) -> None:
    dist.all_to_all_single(out, x, group=group)


def _all_gather_into_direct(
    out: torch.Tensor, x: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> Any:
    """The all-gather itself; with ``async_op`` it returns the work handle."""
    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single(out, x, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)  # torch < 2.13


def _reduce_scatter_into_direct(
    out: torch.Tensor, x: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> Any:
    """The reduce-scatter (sum) itself; with ``async_op`` it returns the work handle."""
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(out, x, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(out, x, group=group, async_op=async_op)  # torch < 2.13


def _gather_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    _all_gather_into(out, x, group)
    return out


class _AllGatherDim0(torch.autograd.Function):
    """All-gather along dim 0; backward is a reduce-scatter (sum) or a local slice (replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, grad_mode: str) -> torch.Tensor:
        ctx.group = group
        ctx.grad_mode = grad_mode
        ctx.local_len = x.shape[0]
        return _gather_dim0(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        group: ProcessGroup = ctx.group
        n = ctx.local_len
        if ctx.grad_mode == "replicated":
            rank = dist.get_rank(group)
            return grad.narrow(0, rank * n, n).contiguous(), None, None
        grad = grad.contiguous()
        out = grad.new_empty((n, *grad.shape[1:]))
        _reduce_scatter_into(out, grad, group)
        return out, None, None


def all_gather_dim0(x: torch.Tensor, group: ProcessGroup, grad_mode: GradMode) -> torch.Tensor:
    """Differentiable all-gather of ``x`` along dim 0, one collective of exactly the payload.

    Args:
        x: Local tensor ``[N, *rest]``, the same shape on every rank.
        group: The CP process group (explicit).
        grad_mode: ``"sum"``: the backward reduce-scatters (sums) the upstream gradient, the exact
            adjoint of the all-gather. ``"replicated"``: each rank keeps its own slice of its own
            upstream gradient, no collective; right when the downstream loss is computed
            identically on every rank.

    Returns:
        ``[C * N, *rest]``, rank-major.
    """
    out: torch.Tensor = _AllGatherDim0.apply(x, group, grad_mode)  # type: ignore[no-untyped-call]
    return out


def all_gather_fixed(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather an int64 vector of the same size on every rank, returned on the CPU.

    It runs on the group's device (an NCCL group: the current GPU), whatever device ``x`` is on.
    Used by the consistency checks, whose size never depends on data (they check that the ranks
    agree before any data-sized collective runs), and for rank maps of an agreed length.

    Args:
        x: LongTensor ``[N]``, the same ``N`` on every rank by construction.
        group: The CP process group.

    Returns:
        LongTensor ``[C, N]`` on the CPU; row ``r`` is rank ``r``'s ``x``.
    """
    return all_gather_stacked(x.to(device="cpu", dtype=torch.long), group)  # one sync


def init_local(
    rank: int,
    world_size: int,
    store_path: str,
    *,
    backend: Literal["gloo", "nccl"] = "gloo",
    timeout_s: float = 60.0,
) -> DeviceMesh:
    """Join a process group of ``world_size`` processes on this machine; return its mesh.

    The ranks meet in a ``FileStore`` at ``store_path`` (a file in a directory private to this
    group of ranks, made by the launcher): no TCP port is picked and released before use, so two
    groups started at once cannot take each other's rendezvous.

    Args:
        rank: This process's rank.
        world_size: Number of processes.
        store_path: The rendezvous file; every rank passes the same path.
        backend: ``"gloo"`` (CPU collectives; a CPU mesh) or ``"nccl"`` (one GPU per rank: rank
            ``r`` makes ``cuda:r`` its current device first; a CUDA mesh).
        timeout_s: Process-group timeout: a collective that waits longer raises.

    Returns:
        A 1-D mesh of all ranks, dimension name ``"cp"``.
    """
    if backend == "nccl":
        torch.cuda.set_device(rank)  # before the group: NCCL binds this rank to its GPU
    dist.init_process_group(
        backend,
        store=dist.FileStore(store_path, world_size),  # type: ignore[attr-defined]  # not in stubs
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return _world_cp_mesh("cuda" if backend == "nccl" else "cpu")


def init_launched(backend: str, mesh_device: str, *, timeout_s: float) -> DeviceMesh:
    """Join the process group a launcher such as ``torchrun`` describes in the environment
    (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), with a finite timeout.

    Args:
        backend: ``"nccl"`` or ``"gloo"``.
        mesh_device: Device type of the returned mesh (``"cuda"`` or ``"cpu"``).
        timeout_s: Process-group timeout: a collective that waits longer raises.

    Returns:
        A 1-D mesh of all launched ranks, dimension name ``"cp"``.
    """
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return _world_cp_mesh(mesh_device)


def _world_cp_mesh(mesh_device: str) -> DeviceMesh:
    """A 1-D mesh of every rank of the default group, dimension name ``"cp"``."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(mesh_device, (dist.get_world_size(),), mesh_dim_names=("cp",))


# --- Trainer integrations (cpshard.integrations) ---------------------------------------------


def world_rank_and_size() -> tuple[int, int]:
    """``(rank, world_size)`` in the default group, ``(0, 1)`` without one."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def dp_cp_mesh(mesh_device: str, cp_size: int) -> DeviceMesh:
    """A 2-D ``("dp", "cp")`` mesh over every rank of the default group, CP innermost.

    Rank ``r`` sits at ``(r // cp_size, r % cp_size)``: the CP groups are runs of consecutive
    ranks (one node's GPUs first), the order accelerate's own meshes use.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh(mesh_device, (world // cp_size, cp_size), mesh_dim_names=("dp", "cp"))


def broadcast_objects(objs: list[Any], group: ProcessGroup) -> list[Any]:
    """The picklable ``objs`` of ``group``'s first rank, on every rank of ``group``.

    Args:
        objs: This rank's objects (same length on every rank; only the first rank's are read).
        group: The process group (e.g. a CP group).

    Returns:
        A new list holding the first rank's objects.
    """
    out = list(objs)
    src = dist.get_global_rank(group, 0)
    dist.broadcast_object_list(out, src=src, group=group)
    return out


def destroy_process_group() -> None:
    """Leave the default process group if one is initialised."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum_(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """In-place sum over ``group`` (no-op without a group); returns ``t``."""
    if group is not None:
        device = _transport(t, group)
        if device is not None:
            moved = _move(t, device)
            dist.all_reduce(moved, group=group)
            t.copy_(moved)
        else:
            dist.all_reduce(t, group=group)
    return t


def all_reduce_sum_mesh_(t: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """In-place sum over every rank of ``mesh`` (any number of dims; one all-reduce per dim)."""
    if mesh is None:
        return t
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            all_reduce_sum_(t, mesh.get_group(dim))
    return t


def all_reduce_sum_coalesced_(tensors: Sequence[torch.Tensor], group: ProcessGroup) -> None:
    """Sum ``tensors`` in place over ``group``: one all-reduce per (dtype, device) bucket."""
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for bucket in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        all_reduce_sum_(flat, group)  # on the group's device where it does not serve this one
        offset = 0
        for t in bucket:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def mesh_contains_this_rank(mesh: DeviceMesh) -> bool:
    """Whether this process is one of ``mesh``'s ranks."""
    return mesh.get_coordinate() is not None


# --- CP attention transport (cpshard.attention) ---------------------------------------------
# Non-differentiable primitives: the attention autograd Functions call them in their forward and
# backward themselves. Every tensor is made contiguous at the boundary.


def group_global_ranks(group: ProcessGroup | None) -> set[int]:
    """The global ranks of ``group`` (``None`` -> the default group); empty if not known."""
    try:
        return set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except (RuntimeError, ValueError, AttributeError):
        return set()


def group_ranks(group: ProcessGroup) -> list[int]:
    """The global ranks of ``group``, in group-rank order."""
    return list(dist.get_process_group_ranks(group))


def group_name(group: ProcessGroup) -> str:
    """The name c10d gave ``group`` (unique per group of the process: two groups over the same
    ranks have different names)."""
    return str(group.group_name)


def group_rank_and_size(group: ProcessGroup) -> tuple[int, int]:
    """``(rank, world_size)`` of this process inside ``group``."""
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_stacked(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather ``x`` from every rank into a new leading dim.

    Args:
        x: Local tensor ``[N, *rest]`` (at least 1-D), the same shape and dtype on every rank.
        group: The CP process group.

    Returns:
        ``[C, *x.shape]``; slice ``r`` is rank ``r``'s ``x``.
    """
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((world, *x.shape))
    _all_gather_into(out.view(world * x.shape[0], *x.shape[1:]), x, group)
    return out


def reduce_scatter_stacked(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum ``x [C, *shape]`` over ranks and keep slice ``rank``: the adjoint of the gather above.

    Args:
        x: ``[C, N, *rest]``; slice ``r`` is this rank's contribution to rank ``r``.
        group: The CP process group.

    Returns:
        ``[*shape]``: the sum over ranks of their slice for this rank.
    """
    x = x.contiguous()
    out = x.new_empty(x.shape[1:])
    _reduce_scatter_into(out, x.view(-1, *x.shape[2:]), group)
    return out


def _start(
    direct: Callable[..., Any], out: torch.Tensor, x: torch.Tensor, group: ProcessGroup
) -> Transfer:
    """``direct(out.view(n, ...), x, group, async_op=True)``, on the group's device where needed
    (synchronous while ``torch.compile`` traces: same result, nothing in flight).

    ``out`` is allocated in the shape the caller wants back: the collective writes it through a
    flat view (dim 0 of ``x``'s shape times the rest), so ``wait()[0]`` is ``out`` itself.
    """
    flat = (-1, *x.shape[1:])
    if torch.compiler.is_compiling():  # dynamo cannot trace work handles: run it now
        _into(direct, out.view(flat), x, group)
        return Transfer([], [out], [])
    device = _transport(x, group)
    if device is not None:
        moved_in = _move(x, device)
        moved_out = moved_in.new_empty(out.shape, dtype=out.dtype)
        work = direct(moved_out.view(flat), moved_in, group, async_op=True)
        return Transfer([work], [moved_out], [moved_in], [out])
    return Transfer([direct(out.view(flat), x, group, async_op=True)], [out], [x])


def all_gather_stacked_start(x: torch.Tensor, group: ProcessGroup) -> Transfer:
    """Start :func:`all_gather_stacked` asynchronously; the caller computes, then waits.

    Under ``torch.compile`` it runs synchronously (dynamo cannot trace work handles). Do not
    write to ``x`` before :meth:`~Transfer.wait`.

    Args:
        x: Local tensor ``[N, *rest]`` (at least 1-D), the same shape and dtype on every rank.
        group: The CP process group.

    Returns:
        The in-flight collective; ``wait()[0]`` is ``[C, *x.shape]``.
    """
    x = x.contiguous()
    out = x.new_empty((dist.get_world_size(group), *x.shape))
    return _start(_all_gather_into_direct, out, x, group)


def reduce_scatter_stacked_start(x: torch.Tensor, group: ProcessGroup) -> Transfer:
    """Start :func:`reduce_scatter_stacked` asynchronously; the caller computes, then waits.

    Under ``torch.compile`` it runs synchronously (dynamo cannot trace work handles). Do not
    write to ``x`` before :meth:`~Transfer.wait`.

    Args:
        x: ``[C, N, *rest]``; slice ``r`` is this rank's contribution to rank ``r``.
        group: The CP process group.

    Returns:
        The in-flight collective; ``wait()[0]`` is ``[N, *rest]``.
    """
    x = x.contiguous()
    return _start(_reduce_scatter_into_direct, x.new_empty(x.shape[1:]), x.flatten(0, 1), group)


def all_to_all_stacked(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-to-all over the leading dim: slice ``j`` goes to rank ``j``.

    Args:
        x: ``[C, *shape]``, the same shape on every rank.
        group: The CP process group.

    Returns:
        ``[C, *shape]``; slice ``j`` is what rank ``j`` sent to this rank.
    """
    x = x.contiguous()
    out = torch.empty_like(x)
    _into(_all_to_all_direct, out, x, group)
    return out


def _all_to_all_split_direct(
    out: torch.Tensor,
    x: torch.Tensor,
    group: ProcessGroup,
    async_op: bool = False,
    *,
    in_splits: list[int],
    out_splits: list[int],
) -> Any:
    """The uneven all-to-all itself; with ``async_op`` it returns the work handle."""
    return dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=async_op)


def all_to_all_split_start(
    x: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int], group: ProcessGroup
) -> Transfer:
    """Start an uneven all-to-all over the leading dim; the caller computes, then waits.

    Rows ``[sum(in_splits[:j]), sum(in_splits[:j+1]))`` of ``x`` go to rank ``j``; the result
    holds, in rank order, ``out_splits[j]`` rows from each rank ``j``. Every rank must pass split
    sizes that agree with its peers' (what ``j`` sends to ``i`` is what ``i`` expects from ``j``):
    the selective K/V exchange derives both sides from the same global plan. Under
    ``torch.compile`` it runs synchronously. Do not write to ``x`` before
    :meth:`~Transfer.wait`.

    Args:
        x: ``[sum(in_splits), *rest]``.
        in_splits: Rows sent to each rank, ``C`` entries.
        out_splits: Rows received from each rank, ``C`` entries.
        group: The CP process group.

    Returns:
        The in-flight collective; ``wait()[0]`` is ``[sum(out_splits), *rest]``.
    """
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    direct = functools.partial(
        _all_to_all_split_direct, in_splits=list(in_splits), out_splits=list(out_splits)
    )
    return _start(direct, out, x, group)


class Transfer:
    """In-flight communication: the ring's point-to-point sends and receives, or an all-gather /
    reduce-scatter started with ``async_op=True``."""

    def __init__(
        self,
        works: list[Any],
        recv: list[torch.Tensor],
        send: list[torch.Tensor],
        targets: list[torch.Tensor] | None = None,
    ) -> None:
        self._works = works
        self._recv = recv
        self._send: list[torch.Tensor] | None = send  # kept alive until the sends complete
        self._targets = targets  # caller-device tensors the moved receives are copied into

    def wait(self) -> list[torch.Tensor]:
        """Block until the communication completed; return the received tensors in order.

        The send buffers are released here (not when this object dies), so a sent tensor that the
        caller no longer references is freed at once.
        """
        for w in self._works:
            w.wait()
        self._works = []
        self._send = None
        if self._targets is not None:
            for target, host in zip(self._targets, self._recv, strict=True):
                target.copy_(host)
            self._recv, self._targets = self._targets, None
        return self._recv


def ring_shift_start(
    xs: Sequence[torch.Tensor], group: ProcessGroup, tags: Sequence[int]
) -> Transfer:
    """Start sending ``xs`` to rank ``(r + 1) % C`` and receiving the same shapes from ``r - 1``.

    One point-to-point message per tensor (no stacking copy), all in one batch. The transfers run
    while the caller computes; call :meth:`Transfer.wait` before using the received tensors or
    writing to ``xs``.

    Under ``torch.compile`` each tensor moves by a synchronous uneven all-to-all instead (all of
    its elements to rank ``r + 1``, nothing to the others: the same bytes on the wire). Dynamo
    does not trace point-to-point ops by default (a graph break, so ``fullgraph=True`` fails), and
    with ``TORCHDYNAMO_ENABLE_P2P_COMPILATION=1`` the traced ring hung on gloo (torch 2.13); the
    all-to-all is a traced collective like the other methods' (exact compiled, fullgraph too).

    Args:
        xs: The tensors to send (each made contiguous here).
        group: The CP process group, ``C >= 2``.
        tags: One message tag per tensor; concurrent rings (e.g. K/V and their gradients) use
            distinct tags.

    Returns:
        The in-flight :class:`Transfer`.
    """
    if len(xs) != len(tags):
        raise ValueError(f"one tag per tensor, got {len(xs)} tensors and {len(tags)} tags")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if torch.compiler.is_compiling():
        return Transfer([], [_ring_shift_traced(x, group, rank, world) for x in xs], [])
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    sends = [x.contiguous() for x in xs]
    recvs = [torch.empty_like(x) for x in sends]
    targets = None
    device = _transport(sends[0], group) if sends else None
    if device is not None:
        targets = recvs
        sends = [_move(x, device) for x in sends]
        recvs = [torch.empty_like(x) for x in sends]
    ops = []
    for send, recv, tag in zip(sends, recvs, tags, strict=True):
        ops.append(dist.P2POp(dist.isend, send, nxt, group, tag))
        ops.append(dist.P2POp(dist.irecv, recv, prv, group, tag))
    works = dist.batch_isend_irecv(ops)
    return Transfer(list(works), recvs, sends, targets)


def _ring_shift_traced(x: torch.Tensor, group: ProcessGroup, rank: int, world: int) -> torch.Tensor:
    """``x`` of rank ``r - 1``, by one uneven all-to-all (synchronous and traceable by dynamo
    under compile, as :func:`all_to_all_split_start` runs there)."""
    n = x.numel()
    in_splits = [n if j == (rank + 1) % world else 0 for j in range(world)]
    out_splits = [n if j == (rank - 1) % world else 0 for j in range(world)]
    out = all_to_all_split_start(x.reshape(-1), in_splits, out_splits, group).wait()[0]
    return out.view(x.shape)


# --- counting collectives (tests, benchmarks) -------------------------------------------------


class CommRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Records every c10d collective and point-to-point op issued while it is active.

    A scoped dispatch mode, nothing global: ``with CommRecorder() as rec: ...`` then read
    :attr:`events` or :meth:`count` / :meth:`bytes_sent`. Each event is ``(kind, bytes)``:
    ``kind`` one of ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``all_reduce``,
    ``broadcast``, ``send``, ``recv``, ``barrier`` or the c10d op name; ``bytes`` the payload this
    rank hands to the op as input (what it sends; ``0`` for a receive). Host-staged collectives
    are recorded once, as the host op they run.
    """

    _KINDS = (
        ("allgather", "all_gather"),
        ("reduce_scatter", "reduce_scatter"),
        ("alltoall", "all_to_all"),
        ("allreduce", "all_reduce"),
        ("broadcast", "broadcast"),
        ("recv", "recv"),
        ("send", "send"),
        ("barrier", "barrier"),
    )

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.events: list[tuple[str, int]] = []

    @classmethod
    def _kind(cls, name: str) -> str:
        op = name.split(".")[1] if "." in name else name
        for key, kind in cls._KINDS:
            if key in op:
                return kind
        return op

    @staticmethod
    def _nbytes(x: object) -> int:
        items = x if isinstance(x, list | tuple) else [x]
        return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name.startswith("c10d."):
            kind = self._kind(name)
            if kind in ("send", "all_reduce", "broadcast"):  # (tensors, ...): the payload first
                sent = self._nbytes(args[0]) if args else 0
            elif kind in ("recv", "barrier"):
                sent = 0
            else:  # (output, input, ...)
                sent = self._nbytes(args[1]) if len(args) > 1 else 0
            self.events.append((kind, sent))
        return func(*args, **(kwargs or {}))

    def count(self, kind: str | None = None) -> int:
        """Number of recorded ops (of ``kind``; every kind for ``None``)."""
        return sum(1 for k, _ in self.events if kind is None or k == kind)

    def bytes_sent(self, kind: str | None = None) -> int:
        """Bytes handed to the recorded ops as input (of ``kind``)."""
        return sum(b for k, b in self.events if kind is None or k == kind)

    def summary(self) -> dict[str, tuple[int, int]]:
        """``{kind: (ops, bytes)}`` of everything recorded."""
        out: dict[str, tuple[int, int]] = {}
        for k, b in self.events:
            n, total = out.get(k, (0, 0))
            out[k] = (n + 1, total + b)
        return out
