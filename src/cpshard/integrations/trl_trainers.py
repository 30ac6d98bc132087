"""Context parallelism for TRL's ``SFTTrainer`` and ``GRPOTrainer``: ``cp_size=C``.

Usage (launch with ``torchrun``; everything else in the script stays)::

    from cpshard.integrations.trl_trainers import CPGRPOTrainer, CPSFTTrainer
    trainer = CPSFTTrainer(model=model, args=SFTConfig(..., padding_free=True), ..., cp_size=2)
    trainer = CPGRPOTrainer(model=model, reward_funcs=..., args=GRPOConfig(...), ..., cp_size=2)

**SFT** (:class:`CPSFTTrainer`): the data, token count, loss and gradient handling of
:class:`~cpshard.integrations.hf_trainer.CPTrainerMixin`. TRL's padding-free batches (packing
``bfd`` / ``bfd_split``, or ``padding_free=True``: one ``[1, T]`` row whose ``position_ids``
restart at 0 per document, plus ``cu_seq_lens_*``) become cpshard packed batches (documents from
the restarting positions, ``balanced`` layout): every rank holds ``T / C`` tokens and attention
stays inside documents. Only ``loss_type="nll"`` is sharded; the SFT metrics (entropy, token
accuracy, token count) are not logged under CP.

**GRPO** (:class:`CPGRPOMixin`): TRL generates and scores on every rank and computes the loss
from per-token log-probabilities of ``[B, P + K]`` prompt+completion rows. Under CP:

* the sampler hands out ``generation_batch_size / C`` distinct sequences per round (the dp
  replicas' share), and every CP rank of a replica gets the same prompts;
* every CP rank generates (so FSDP / ZeRO collectives inside ``generate`` stay paired), then the
  CP leader's completions and its torch RNG state are broadcast to its peers, so the peers hold
  identical rows and shuffle them identically;
* ``_get_per_token_logps_and_entropies`` shards the rows with :func:`cpshard.prepare_cp_forward`
  (left-padded prompts honoured as padding), computes this rank's log-probabilities and
  entropies, and brings them back to the caller's ``[B, P + K]`` with
  ``sharder.gather_token_tensor`` (differentiable, ``grad="sum"``) before TRL slices the
  completion; TRL's loss then runs unchanged and identically on the CP peers. The all-gather's
  summed backward gives each rank ``C`` times its share, which DDP's mean over the ``W`` ranks
  turns into the dp mean: the gradients of the run without CP.

Refused under CP, before the first step (besides the Trainer settings): a reward group split
over replicas (``num_generations`` must divide ``per_device_train_batch_size *
steps_per_generation``), ``scale_rewards="batch"`` and ``multi_objective_aggregation=
"normalize_then_sum"`` (statistics over the world-gathered batch would count each replica ``C``
times), multimodal inputs and MoE auxiliary losses.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.sft_trainer import SFTTrainer
from trl.trainer.utils import RepeatSampler

from cpshard import _comm
from cpshard.dispatch import prepare_cp_forward
from cpshard.integrations.hf_trainer import (
    CPDataMixin,
    CPTrainerMixin,
    _setting_error,
    check_ddp_over_world,
)
from cpshard.sharding.labels import shift_labels

__all__ = ["CPGRPOMixin", "CPGRPOTrainer", "CPSFTMixin", "CPSFTTrainer"]


class CPSFTMixin(CPTrainerMixin):
    """:class:`CPTrainerMixin` plus the SFT settings it does not shard (checked at init)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.cp is None:
            return
        loss_type = getattr(cast(Any, self).args, "loss_type", "nll")
        if loss_type != "nll":
            raise _setting_error(
                "loss_type",
                "is not sharded by CPSFTTrainer (only the token cross-entropy is)",
                loss_type,
                "use loss_type='nll'",
            )


class CPSFTTrainer(CPSFTMixin, SFTTrainer):  # type: ignore[misc]
    """TRL ``SFTTrainer`` with ``cp_size`` (see the module docstring)."""


class CPGRPOMixin(CPDataMixin):
    """Adds ``cp_size`` to TRL's ``GRPOTrainer`` (put it first in the bases)."""

    # TRL methods this mixin overrides: if a TRL release renames one, the override would be
    # dead code and CP silently wrong, so their presence is checked at init.
    _OVERRIDES = ("_generate_single_turn", "_get_per_token_logps_and_entropies")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bases = [k for k in type(self).__mro__ if not issubclass(CPGRPOMixin, k)]
        missing = [m for m in self._OVERRIDES if not any(m in vars(k) for k in bases)]
        if missing:
            raise TypeError(
                f"CPGRPOTrainer: this TRL version has no {missing}, which cpshard's GRPO "
                "integration overrides (written against trl 1.16); install trl 1.16"
            )
        super().__init__(*args, **kwargs)
        if self.cp is not None:
            _check_grpo(cast(Any, self), self.cp.cp_size)

    def _get_train_sampler(self, dataset: Any = None) -> Any:
        """TRL's ``RepeatSampler`` over the dp replicas' share of a generation round."""
        me = cast(Any, self)
        if self.cp is None:
            return cast(Any, super())._get_train_sampler(dataset)
        return RepeatSampler(
            data_source=me.train_dataset if dataset is None else dataset,
            mini_repeat_count=me.num_generations,
            batch_size=me.args.generation_batch_size // self.cp.cp_size // me.num_generations,
            repeat_count=me.num_iterations * me.args.steps_per_generation,
            shuffle=me.shuffle_dataset,
            seed=me.args.seed,
        )

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's generation on every rank; the CP leader's completions and RNG on its peers."""
        completion_ids, logprobs = cast(Any, super())._generate_single_turn(*args, **kwargs)
        if self.cp is None:
            return completion_ids, logprobs
        group = _comm.cp_group(self.cp.cp_mesh)
        assert group is not None
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        completion_ids, logprobs, cpu_rng, cuda_rng = _comm.broadcast_objects(
            [completion_ids, logprobs, torch.get_rng_state(), cuda], group
        )
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng)
        return completion_ids, logprobs

    def _get_per_token_logps_and_entropies(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **extra: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Per-token log-probs (and entropies) of the completion, ``[B, K]``, computed under CP.

        Args:
            model: The (DDP-wrapped) policy or the reference model.
            input_ids: ``[B, P + K]`` left-padded prompts then right-padded completions.
            attention_mask: ``[B, P + K]``, 0 at pads.
            logits_to_keep: ``K``, the completion length.
            batch_size: TRL's chunk size (unused: the rows are sharded along the sequence).
            compute_entropy: Also return the entropies ``[B, K]``.
            compute_aux_loss: MoE load-balancing loss (refused under CP).
            **extra: Multimodal inputs (refused under CP when given).

        Returns:
            ``(logps [B, K], entropies [B, K] | None, None)``: 0 at masked completion slots.
        """
        if self.cp is None:
            return cast(
                tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                cast(Any, super())._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size,
                    compute_entropy, compute_aux_loss, **extra,
                ),
            )  # fmt: skip
        given = sorted(k for k, v in extra.items() if v is not None)
        if given or compute_aux_loss:
            raise ValueError(
                f"CPGRPOTrainer: {given or ['an MoE aux loss']} are not sharded under CP; train "
                "text-only, dense models with cp_size > 1"
            )
        if isinstance(model, DistributedDataParallel):  # the policy (the reference is bare)
            check_ddp_over_world(model, self.cp)
        seq = input_ids.shape[1]
        pad = attention_mask == 0
        labels = shift_labels(input_ids, padding_mask=pad)  # target of t: token t + 1
        labels[:, : seq - logits_to_keep - 1] = -100  # only completion tokens are scored
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        cp = self.cp
        ctx, local, sharder = prepare_cp_forward(
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
        logits = (out.logits if hasattr(out, "logits") else out[0]).float()
        logits = logits / float(cast(Any, self).temperature)
        logp_all = torch.log_softmax(logits, dim=-1)
        target = local["labels"]
        scored = target != -100
        logp = logp_all.gather(-1, target.clamp(min=0)[..., None])[..., 0]
        logp = logp.masked_fill(~scored, 0.0)
        window = slice(seq - logits_to_keep - 1, seq - 1)  # position t predicts token t + 1
        full = sharder.gather_token_tensor(logp, trim=True, fill=0.0)
        entropies = None
        if compute_entropy:
            ent = -(logp_all.exp() * logp_all).sum(-1).masked_fill(~scored, 0.0)
            entropies = sharder.gather_token_tensor(ent, trim=True, fill=0.0)[:, window]
        return full[:, window], entropies, None


def _check_grpo(trainer: Any, cp_size: int) -> None:
    """GRPO settings that contradict CP, named, before any collective."""
    args = trainer.args
    per_rank = args.per_device_train_batch_size * args.steps_per_generation
    if per_rank % trainer.num_generations:
        raise _setting_error(
            "num_generations",
            f"must divide per_device_train_batch_size * steps_per_generation = {per_rank} under "
            "CP, so no reward group is split between data-parallel replicas",
            trainer.num_generations,
            "pick per_device_train_batch_size (or steps_per_generation) as a multiple of it",
        )
    if trainer.scale_rewards == "batch":
        raise _setting_error(
            "scale_rewards",
            "takes a std over the world-gathered rewards, where CP repeats every replica C times",
            "batch",
            "use scale_rewards='group' or 'none'",
        )
    if getattr(trainer, "multi_objective_aggregation", "") == "normalize_then_sum":
        raise _setting_error(
            "multi_objective_aggregation",
            "normalises over the world-gathered rewards, where CP repeats every replica C times",
            "normalize_then_sum",
            "use 'sum_then_normalize'",
        )
    if args.generation_batch_size % (cp_size * trainer.num_generations):
        raise _setting_error(
            "generation_batch_size",
            "must be a multiple of cp_size * num_generations = "
            f"{cp_size * trainer.num_generations}",
            args.generation_batch_size,
            "adjust per_device_train_batch_size or steps_per_generation",
        )


class CPGRPOTrainer(CPGRPOMixin, GRPOTrainer):  # type: ignore[misc]
    """TRL ``GRPOTrainer`` with ``cp_size`` (see the module docstring)."""
