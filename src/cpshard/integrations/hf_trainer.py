"""Context parallelism for an existing HF ``transformers.Trainer`` script: ``cp_size=C``.

Usage (the rest of the script is unchanged; launch with ``torchrun``)::

    from cpshard.integrations.hf_trainer import CPTrainer
    trainer = CPTrainer(model=model, args=args, train_dataset=ds, cp_size=2)  # was Trainer(...)
    trainer.train()

or, for a Trainer subclass of your own, ``class MyCPTrainer(CPTrainerMixin, MyTrainer)``.

Why a mixin (a subclass) and not a collator or a callback: CP needs four things the Trainer
decides per step, and only its overridable methods see them. Callbacks never see the batch, the
loss or the token count, and ``on_pre_optimizer_step`` runs after clipping; a collator runs
before ``num_items_in_batch`` is counted and, with ``dataloader_num_workers > 0``, in worker
processes without collectives. The mixin overrides public methods only:

1. **Data** (``get_train_dataloader``): the ``C`` CP ranks of a data-parallel replica must get
   the same batches. accelerate shards batches over the whole world (rank ``r`` takes batches
   ``r, r + W, ...``); the mixin re-points the shard of the dataloader it returns at
   ``dp = W / C`` replicas (``process_index = r // C``), the same attributes transformers itself
   resets for its rank-aware sampler. So the sampler, the epoch length and gradient accumulation
   all see ``dp`` replicas. The epoch's last partial batch is what a run without CP on ``dp``
   processes gets: kept partial for one replica (as in one process), completed with repeated
   samples by accelerate's ``even_batches`` for ``dp > 1`` (as in any multi-process run).
2. **Token count** (``get_cp_size``): ``num_items_in_batch`` is counted on the unsharded batches
   of every rank and summed over the world, so every token is counted ``C`` times; the Trainer
   divides by ``get_cp_size()``, which returns ``C`` (a Trainer that does not call it, e.g.
   transformers 5.17, leaves the division to the CP loss:
   :func:`trainer_count_divides_by_cp_size`).
3. **Forward and loss** (``compute_loss``): the batch (dense rows with ``attention_mask``, or
   TRL's padding-free rows with ``position_ids`` restarting per document) is labelled on the
   global sequence as the model's own loss shifts it (target of ``t`` = ``labels[t + 1]`` over
   the row, so the targets are the ones ``num_items_in_batch`` counts), sharded with
   :func:`cpshard.prepare_cp_forward`, run under its ``ctx()``, and each rank returns its share
   of the global mean: ``sum over its tokens / num_items_in_batch * W``. A target at a padded
   position (left padding whose first token keeps its label: the pad before it would predict
   it, with logits that depend on the attention implementation) has no CP-exact loss: every
   rank raises before the step (``get_batch_samples``, one all-reduce of the count).
4. **Gradients**: the Trainer's DDP averages over all ``W`` ranks; with the ``* W`` above that
   average is exactly the CP *sum* and the dp *mean* (:func:`cpshard.sync_grads` followed by a
   dp mean gives the same numbers; DDP does it in one all-reduce). The DDP group must be the
   whole world, which is checked before the first forward.

Settings that contradict CP raise a ``ValueError`` naming the setting, on every rank, before the
first step: ``cp_size`` not dividing the world, accelerate's own ``parallelism_config`` CP/SP/TP,
``dispatch_batches`` / ``split_batches`` or an iterable dataset, the rank-aware
``train_sampling_strategy="batch_rebalance"`` or a ``DistributedSampler``, a model already
wrapped in DDP, DeepSpeed / FSDP, evaluation during training, ``average_tokens_across_devices``
off, label smoothing and ``compute_loss_func``. ``cp_size=1`` is the base trainer unchanged.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainingArguments

from cpshard import _comm, _compat
from cpshard.attention import checkpoint_context_fn
from cpshard.dispatch import prepare_cp_forward
from cpshard.layouts.documents import PackSpec
from cpshard.loss import count_tokens, cp_cross_entropy
from cpshard.sharding.labels import shift_labels

__all__ = [
    "CPDataMixin",
    "CPSetup",
    "CPTrainer",
    "CPTrainerMixin",
    "cp_batch_from_trainer_inputs",
]

# Keys of a Trainer / TRL batch that cpshard understands (the rest is refused under CP).
_MODEL_KEYS = ("input_ids", "attention_mask", "position_ids")
_LABEL_KEYS = ("labels", "shift_labels")
# TRL's padding-free collator also emits these; they describe the same documents as position_ids.
_DOC_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _setting_error(setting: str, rule: str, value: object, fix: str) -> ValueError:
    return ValueError(f"CP trainer: {setting}={value!r} {rule}. Fix: {fix}")


@dataclass(frozen=True)
class CPSetup:
    """The CP facts of one trainer on this rank.

    Attributes:
        cp_size: ``C``, ranks that share one batch.
        world_size: ``W``, all ranks.
        rank: This rank in the world.
        mesh: The 2-D ``("dp", "cp")`` mesh (CP innermost: rank ``r`` is in replica ``r // C``).
        padding_token_id: Pad id handed to :func:`cpshard.prepare_cp_forward`.
        attention: CP attention method (``all_gather``, ``ring``, ``ulysses``).
        layout: Layout request for :func:`cpshard.prepare_cp_forward` (``auto`` by default).
    """

    cp_size: int
    world_size: int
    rank: int
    mesh: DeviceMesh
    padding_token_id: int
    attention: str
    layout: str

    @property
    def dp_size(self) -> int:
        """``W / C`` data-parallel replicas."""
        return self.world_size // self.cp_size

    @property
    def dp_rank(self) -> int:
        """This rank's replica, ``rank // C``."""
        return self.rank // self.cp_size

    @property
    def cp_mesh(self) -> DeviceMesh:
        """The 1-D CP mesh of this rank's replica."""
        return self.mesh["cp"]


def check_cp_size(cp_size: object, world_size: int) -> int:
    """``cp_size`` as an int that divides the world, else a ``ValueError`` naming it."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise _setting_error("cp_size", "must be an int >= 1", cp_size, "pass e.g. cp_size=2")
    if world_size % cp_size:
        raise _setting_error(
            "cp_size",
            f"must divide the number of processes (world size {world_size})",
            cp_size,
            f"launch a multiple of {cp_size} processes, or pick a divisor of {world_size}",
        )
    return cp_size


def _pad_id(trainer: Any) -> int:
    """The pad id: the tokenizer's, else the model config's, else 0 (pads are masked anyway)."""
    for owner in (
        getattr(trainer, "processing_class", None),
        getattr(trainer.model, "config", None),
    ):
        tok = getattr(owner, "tokenizer", owner)  # a processor holds its tokenizer
        pad = getattr(tok, "pad_token_id", None)
        if isinstance(pad, int) and pad >= 0:
            return pad
    return 0


def _check_args(trainer: Any, cp_size: int) -> None:
    """Every Trainer setting that contradicts CP, named, before any collective."""
    args = trainer.args
    pc = getattr(args, "parallelism_config", None) or getattr(
        trainer.accelerator, "parallelism_config", None
    )
    if pc is not None and any(
        getattr(pc, f"{k}_size", 1) > 1 for k in ("cp", "sp", "tp", "dp_shard")
    ):
        raise _setting_error(
            "parallelism_config",
            "enables accelerate's own CP/SP/TP/FSDP sharding, which cpshard replaces",
            pc,
            "leave parallelism_config=None and pass cp_size to the cpshard trainer",
        )
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise _setting_error(
            "deepspeed/fsdp",
            "is not supported by the cpshard trainers (their gradient reduction is not the "
            "world-wide DDP mean the loss scale assumes)",
            getattr(args, "deepspeed", None) or getattr(args, "fsdp", None),
            "train with DDP (the default), or use cpshard in your own loop with FSDP2 "
            "(README: Training loops)",
        )
    if str(getattr(args, "train_sampling_strategy", "")) in ("batch_rebalance",):
        raise _setting_error(
            "train_sampling_strategy",
            "is rank-aware (it gives every rank, so every CP rank, different batches)",
            args.train_sampling_strategy,
            "use 'random', 'sequential' or 'group_by_length'",
        )
    acc_cfg = getattr(args, "accelerator_config", None)
    for name in ("dispatch_batches", "split_batches"):
        if getattr(acc_cfg, name, None):
            raise _setting_error(
                f"accelerator_config.{name}",
                "splits each batch across the processes, so the CP ranks of a replica would get "
                "different samples",
                True,
                f"set accelerator_config={{'{name}': False}}",
            )
    if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
        raise _setting_error(
            "train_dataset",
            "is an IterableDataset, which accelerate shards over every process (dispatching or "
            "per-process shards), not over data-parallel replicas",
            type(trainer.train_dataset).__name__,
            "use a map-style dataset (e.g. datasets.Dataset)",
        )
    if str(getattr(args, "eval_strategy", "no")).split(".")[-1].lower() != "no":
        raise _setting_error(
            "eval_strategy",
            "asks for evaluation during training, which the cpshard trainers do not shard yet",
            args.eval_strategy,
            "set eval_strategy='no' and evaluate with the base trainer (cp_size=1)",
        )
    if not getattr(args, "average_tokens_across_devices", True):
        raise _setting_error(
            "average_tokens_across_devices",
            "must be True under CP: the loss is normalised by the token count of the whole step",
            False,
            "leave it at its default (True)",
        )
    if getattr(args, "label_smoothing_factor", 0.0):
        raise _setting_error(
            "label_smoothing_factor",
            "is not implemented by the cpshard trainers' loss",
            args.label_smoothing_factor,
            "set label_smoothing_factor=0",
        )
    # TRL (< transformers 5.19) sets compute_loss_func to a non-callable marker meaning "the
    # loss is already scaled for gradient accumulation"; it is never called as a loss function
    if callable(getattr(trainer, "compute_loss_func", None)):
        raise _setting_error(
            "compute_loss_func",
            "would see only this rank's shard of the logits",
            trainer.compute_loss_func,
            "drop it (the cpshard trainers compute the CP-correct cross-entropy)",
        )
    if isinstance(trainer.model, DistributedDataParallel):
        raise _setting_error(
            "model",
            "is already wrapped in DistributedDataParallel; the trainer wraps it over the whole "
            "world and cpshard scales the loss for that wrapper",
            type(trainer.model).__name__,
            "pass the bare model",
        )


def setup_cp(trainer: Any, cp_size: object, attention: str, layout: str) -> CPSetup | None:
    """Check the trainer's settings and build its CP mesh; ``None`` at ``cp_size == 1``."""
    rank, world = _comm.world_rank_and_size()
    size = check_cp_size(cp_size, world)
    if size == 1:
        return None
    _check_args(trainer, size)
    device = getattr(trainer.args, "device", torch.device("cpu"))
    mesh = _comm.dp_cp_mesh("cuda" if torch.device(device).type == "cuda" else "cpu", size)
    return CPSetup(size, world, rank, mesh, _pad_id(trainer), attention, layout)


def shard_dataloader_by_dp(dataloader: Any, cp: CPSetup) -> Any:
    """Re-point accelerate's batch shard of ``dataloader`` at the ``dp`` replicas (in place).

    Raises:
        ValueError: a dataloader accelerate did not shard by batches (dispatching, iterable
            datasets), or a rank-aware sampler inside it.
    """
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher

    if isinstance(dataloader, DataLoaderDispatcher):
        raise _setting_error(
            "accelerator_config.dispatch_batches",
            "makes rank 0 split every batch over all processes",
            True,
            "set accelerator_config={'dispatch_batches': False}",
        )
    shard = getattr(dataloader, "batch_sampler", None)
    if not isinstance(shard, BatchSamplerShard):
        raise _setting_error(
            "train dataloader",
            "was not sharded by accelerate's BatchSamplerShard, so cpshard cannot give the CP "
            "ranks of a replica the same batches",
            type(shard).__name__,
            "use a map-style dataset and the trainer's own get_train_dataloader",
        )
    inner = getattr(shard.batch_sampler, "sampler", shard.batch_sampler)
    if isinstance(inner, torch.utils.data.DistributedSampler) or hasattr(inner, "num_replicas"):
        raise _setting_error(
            "train sampler",
            "is rank-aware (a DistributedSampler gives every rank, so every CP rank, different "
            "samples)",
            type(inner).__name__,
            "return a rank-independent sampler from _get_train_sampler (accelerate shards it)",
        )
    shard.num_processes = cp.dp_size
    shard.process_index = cp.dp_rank
    if cp.dp_size == 1:
        # accelerate shards a sampler only for several processes; its `even_batches` completes
        # the epoch's last partial batch with repeated samples so every process gets one. One
        # replica is one process: its last batch stays partial, as without a shard.
        shard.even_batches = False
    return dataloader


def _shifted_targets(inputs: Mapping[str, Any]) -> torch.Tensor | None:
    """``[B, S]``: the target of every position, as transformers' causal-LM loss takes it.

    ``shift_labels`` when the collator gives them, else ``labels[:, t + 1]`` (``-100`` at the
    row end): the model shifts the labels over the whole row, whatever the attention mask or the
    documents say, and the Trainer counts ``num_items_in_batch`` on exactly these targets.
    """
    given = inputs.get("shift_labels")
    if given is not None:
        return cast(torch.Tensor, given)
    raw = inputs.get("labels")
    return None if raw is None else shift_labels(cast(torch.Tensor, raw))


def scored_pad_positions(inputs: Mapping[str, Any]) -> torch.Tensor:
    """``[N, 2]`` (row, position) of the padded positions that the loss would score.

    transformers shifts the labels over the row, so the pad just before a left-padded row's
    first token has that token as its target (the row's label there is not ``-100``). That
    pad's query attends to no token: its logits depend on the attention implementation (sdpa and
    flash attention give it a zero attention output, eager a uniform average of the row), and
    under CP a pad attends to itself. Such a batch has no CP-exact loss.

    Returns:
        The positions (empty without an ``attention_mask`` or without labels).
    """
    mask = inputs.get("attention_mask")
    targets = _shifted_targets(inputs)
    if not isinstance(mask, torch.Tensor) or targets is None or mask.shape != targets.shape:
        return torch.zeros(0, 2, dtype=torch.long)
    return ((mask == 0) & (targets != -100)).nonzero()


def _scored_pads_error(count: int, example: str) -> ValueError:
    return ValueError(
        f"CP trainer: the loss would score {count} padded position(s) of this step's batches"
        f"{example}. transformers' causal-LM loss shifts the labels itself (the target of "
        "position t is labels[t + 1]), so a pad followed by a labelled token is scored: the pad "
        "just before a left-padded row's first token, or right pads whose labels are not -100. "
        "Such a pad attends to no real token before it: its logits depend on the attention "
        "implementation (sdpa/flash: zero attention output, eager: a uniform average), and under "
        "CP a pad attends to itself, so that loss cannot be reproduced. Fix: in the collator, "
        "labels[:, 1:][attention_mask[:, :-1] == 0] = -100 (no pad has a target), or pad on the "
        "right with labels -100 at the pads"
    )


def cp_batch_from_trainer_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """A Trainer / TRL batch as a cpshard batch with labels shifted on the global sequence.

    Dense rows: ``input_ids`` ``[B, S]``, ``labels`` (unshifted, as HF models take them) or
    ``shift_labels``, optional ``attention_mask`` (any padding side). Padding-free rows (TRL's
    ``padding_free`` / packing collator): ``input_ids`` ``[1, T]`` with ``position_ids``
    restarting at 0 per document (any step other than +1 starts one, as transformers reads
    them) and no ``attention_mask``; the ``cu_seq_lens_*`` / ``max_length_*`` / ``seq_idx``
    keys describe the same documents and are dropped.

    The targets are the model's own: ``labels`` shifted over the whole row (a document's last
    token gets the next label, as without CP: ``-100`` there when the collator masks document
    starts, as TRL's does), so their count is the Trainer's ``num_items_in_batch``.

    Returns:
        ``{"input_ids", "labels" (pre-shifted), "attention_mask" | "seq_lens"}`` (plus the
        given ``position_ids``); the caller's tensors are not modified.

    Raises:
        ValueError: no ``input_ids`` or labels, keys cpshard cannot shard, or a padded position
            the loss would score (:func:`scored_pad_positions`).
    """
    unknown = sorted(
        k
        for k, v in inputs.items()
        if v is not None and k not in (*_MODEL_KEYS, *_LABEL_KEYS, *_DOC_KEYS, "use_cache")
    )
    if unknown:
        raise ValueError(
            f"CP trainer: the batch has keys {unknown} that the cpshard trainers do not shard "
            f"(they take {list(_MODEL_KEYS + _LABEL_KEYS)} and TRL's padding-free keys). Fix: "
            "drop them in the collator, or use cpshard in your own loop (README: Training loops)"
        )
    if inputs.get("input_ids") is None:
        raise ValueError("CP trainer: the batch has no input_ids (inputs_embeds are not handled)")
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    pos = inputs.get("position_ids")
    packed = mask is None and (pos is not None or inputs.get("cu_seq_lens_q") is not None)
    labels = _shifted_targets(inputs)
    if labels is None:
        raise ValueError("CP trainer: the batch has neither labels nor shift_labels")
    scored = scored_pad_positions(inputs)
    if len(scored):
        b, t = (int(v) for v in scored[0])
        raise _scored_pads_error(len(scored), f" (row {b}, position {t})")
    batch: dict[str, Any] = {"input_ids": ids}
    if packed:
        # The documents as seq_lens: the dispatcher then picks a packed layout.
        docs = {"position_ids": pos} if pos is not None else {"cu_seqlens": inputs["cu_seq_lens_q"]}
        spec = PackSpec.from_documents((ids.shape[0], ids.shape[1]), **docs)
        batch["seq_lens"] = [list(row) for row in spec.doc_lens]
    elif mask is not None:
        batch["attention_mask"] = mask
    if pos is not None:  # the RoPE positions the model would see without CP
        batch["position_ids"] = pos
    batch["labels"] = labels
    return batch


def _logits(out: Any) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return cast(torch.Tensor, logits)


def _checkpoint_under_cp(args: Any) -> None:
    """Activation checkpointing (on by default in TRL's SFTConfig) must recompute under CP.

    The trainer enables it with ``args.activation_checkpointing_kwargs`` (transformers 5;
    ``gradient_checkpointing_kwargs`` before); they get ``use_reentrant=False`` and cpshard's
    recompute context. An explicit reentrant request is refused: its recomputation cannot see the
    CP context.
    """
    if args is None:
        return
    for on, name in (
        ("activation_checkpointing", "activation_checkpointing_kwargs"),
        ("gradient_checkpointing", "gradient_checkpointing_kwargs"),
    ):
        if not getattr(args, on, False) or not hasattr(args, name):
            continue
        kwargs = dict(getattr(args, name, None) or {})
        if kwargs.get("use_reentrant") is True:
            raise _setting_error(
                f"{name}['use_reentrant']",
                "recomputes attention outside the CP context (silently wrong gradients)",
                True,
                "drop it (the cpshard trainers use the non-reentrant variant)",
            )
        kwargs.update(use_reentrant=False, context_fn=checkpoint_context_fn)
        setattr(args, name, kwargs)


class CPDataMixin:
    """The CP setup, the dp-sharded dataloader and the token-count divisor of a CP trainer.

    Shared by :class:`CPTrainerMixin` (which adds the CP loss) and the GRPO mixin (whose loss
    TRL computes from CP log-probabilities).

    Args (keywords, besides the trainer's own):
        cp_size: CP ranks per data-parallel replica (``1``: the base trainer unchanged).
        cp_attention: CP attention method (``"all_gather"``, ``"ring"``, ``"ulysses"``).
        cp_layout: Layout request (``"auto"``: ``balanced`` for padding-free / packed rows,
            ``round_robin`` for dense rows).
    """

    def __init__(
        self,
        *args: Any,
        cp_size: int = 1,
        cp_attention: str = "all_gather",
        cp_layout: str = "auto",
        **kwargs: Any,
    ) -> None:
        self.cp: CPSetup | None = None
        check_cp_size(cp_size, _comm.world_rank_and_size()[1])  # before the (slow) base init
        if cp_size > 1:
            given = (*args, *kwargs.values())
            _checkpoint_under_cp(next((a for a in given if isinstance(a, TrainingArguments)), None))
        cast(Any, super()).__init__(*args, **kwargs)
        self.cp = setup_cp(self, cp_size, cp_attention, cp_layout)

    # --- Trainer extension points --------------------------------------------------------
    def get_cp_size(self) -> int:
        """``C``: the Trainer divides the world-summed token count by it."""
        return self.cp.cp_size if self.cp is not None else cast(Any, super()).get_cp_size()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """Evaluation is not sharded under CP: a clear error instead of duplicated metrics."""
        if self.cp is not None:
            raise _setting_error(
                "evaluate()",
                "is not sharded by the cpshard trainers (every CP rank would evaluate the same "
                "batches and the metrics would count them C times)",
                f"cp_size={self.cp.cp_size}",
                "evaluate with the base trainer (cp_size=1) on the saved model",
            )
        return cast(Any, super()).get_eval_dataloader(eval_dataset)

    def get_train_dataloader(self) -> Any:
        """The trainer's dataloader, sharded over the dp replicas instead of every rank."""
        dataloader = cast(Any, super()).get_train_dataloader()
        if self.cp is not None:
            shard_dataloader_by_dp(dataloader, self.cp)
        return dataloader


class CPTrainerMixin(CPDataMixin):
    """Adds ``cp_size`` to a ``transformers.Trainer`` (sub)class; put it first in the bases.

    Keywords as :class:`CPDataMixin`; the loss is cpshard's (see the module docstring).
    """

    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: torch.device
    ) -> tuple[list[Any], torch.Tensor | int | None]:
        """The Trainer's batches of one optimizer step; a batch whose loss would score a padded
        position (:func:`scored_pad_positions`) is refused on every rank before the step."""
        samples, count = cast(Any, super()).get_batch_samples(epoch_iterator, num_batches, device)
        if self.cp is not None:
            check_no_scored_pads(samples, self.cp)
        return samples, count

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """This rank's share of the global mean cross-entropy (see the module docstring)."""
        if self.cp is None:
            return cast(Any, super()).compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if return_outputs:
            raise ValueError(
                "CP trainer: compute_loss(return_outputs=True) (prediction / evaluation) is not "
                "sharded yet; evaluate with the base trainer (cp_size=1)"
            )
        check_ddp_over_world(model, self.cp)
        cp = self.cp
        batch = cp_batch_from_trainer_inputs(inputs)
        ctx, local, _ = prepare_cp_forward(
            model,
            cp.cp_mesh,
            batch,
            padding_token_id=cp.padding_token_id,
            layout=cp.layout,  # type: ignore[arg-type]
            attention=cp.attention,
        )
        with ctx():
            out = model(
                input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False
            )
        if num_items_in_batch is not None:
            # Normalised over the accumulation window and the world; DDP's mean over W undone.
            count: int | torch.Tensor = num_items_in_batch
            if not trainer_count_divides_by_cp_size():  # every token was counted C times
                count = torch.as_tensor(num_items_in_batch, dtype=torch.float64) / cp.cp_size
            scale = float(cp.world_size)
        else:
            # A per-micro-batch mean over this replica; DDP's mean over its C ranks undone.
            count = count_tokens(batch["labels"])
            scale = float(cp.cp_size)
        return cp_cross_entropy(_logits(out), local["labels"], num_tokens=count, scale=scale)


@functools.cache
def trainer_count_divides_by_cp_size() -> bool:
    """Whether the installed ``transformers.Trainer`` divides ``num_items_in_batch`` by
    ``get_cp_size()``.

    Its token count is summed over the world, where the ``C`` CP ranks of a replica hold the same
    batches, so every token is counted ``C`` times. Newer Trainers (5.25 seen) divide the count
    by ``get_tp_size() * get_cp_size() * get_sp_size()``; older ones (5.17 seen) divide only by
    accelerate's ``parallelism_config`` sizes, never calling ``get_cp_size``: the CP loss then
    divides by ``C`` itself. Read from the Trainer's own counting methods' source.
    """
    sources = []
    for method in _compat.trainer_token_count_methods(Trainer):
        try:
            sources.append(inspect.getsource(method))
        except (OSError, TypeError) as e:
            raise RuntimeError(
                "CP trainer: cannot read transformers.Trainer's token-count source to tell whether "
                f"it divides num_items_in_batch by get_cp_size() ({e})"
            ) from e
    return any("get_cp_size()" in src for src in sources)


def check_no_scored_pads(samples: list[Any], cp: CPSetup) -> None:
    """Refuse, on every rank, a step whose batches would score a padded position.

    Each rank counts :func:`scored_pad_positions` in its own batches; one all-reduce of the
    count over the world (the data-parallel replicas hold different batches) lets every rank
    raise together instead of leaving the others in the step's gradient all-reduce.

    Raises:
        ValueError: some rank's batches would score a padded position.
    """
    local = sum(len(scored_pad_positions(s)) for s in samples if isinstance(s, Mapping))
    total = torch.tensor([local], dtype=torch.int64)
    _comm.all_reduce_sum_mesh_(total, cp.mesh)
    if int(total):  # every CP rank of a replica counted the replica's batches
        raise _scored_pads_error(max(int(total) // cp.cp_size, 1), "")


def check_ddp_over_world(model: nn.Module, cp: CPSetup) -> None:
    """The trainer's DDP must average over the whole world (the loss scale assumes it).

    Raises:
        ValueError: DDP over another group (e.g. only the CP ranks, or a subgroup).
    """
    if not isinstance(model, DistributedDataParallel):
        raise _setting_error(
            "model wrapper",
            "is not the trainer's DistributedDataParallel over the world, whose gradient mean "
            "the cpshard loss scale undoes",
            type(model).__name__,
            "let the trainer wrap the model (DDP is the default on several processes)",
        )
    group = getattr(model, "process_group", None)
    size = group.size() if group is not None else cp.world_size
    if size != cp.world_size:
        raise _setting_error(
            "DistributedDataParallel process_group",
            f"must be the whole world ({cp.world_size} ranks), not a group of {size}",
            size,
            "wrap with DDP over the default group (the trainer does); cpshard sums over CP",
        )


class CPTrainer(CPTrainerMixin, Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` with ``cp_size`` (see :class:`CPTrainerMixin`)."""
