"""The options of one prepare, built from the keywords of either public entry point, validated once.

:func:`cpshard.prepare_cp_forward` and :func:`cpshard.make_cp_batch_and_ctx` keep their own
signatures; each turns its keywords into one frozen :class:`PrepareOptions` and hands it to the
one prepare pipeline of :mod:`cpshard.dispatch`. :meth:`PrepareOptions.problem` is the
pipeline's argument check, once per call on every rank; the pipeline raises what it finds right
after the one step header, whose batch fingerprint carries these options: an option given wrong
on every rank raises on every rank, and one given wrong (or differently) on one rank only raises
on every rank too ("given different ..."), where raising before the header would leave the other
ranks waiting in its all-gather. What it does not check, and who does:

* ``padding_token_id``: its rule depends on the batch (``None`` only without ``input_ids``) and
  on the model's vocabulary, so the pipeline checks it once, with the batch, after the ranks
  agreed on the batch (:func:`cpshard.sharding.pad_id.check_padding_token_id`);
* ``pad_multiple``: the ``contiguous`` layout checks its own parameter when it is built;
* ``extra_token_keys``, ``loss_mask``: the sharder checks them against the batch they describe.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard.attention.cost import CostModel
from cpshard.names import ATTENTION_CHOICES, LAYOUT_NAMES, AttentionChoice, LayoutName
from cpshard.sharding.batch import TokenKey
from cpshard.sharding.sharder import CPSharder

__all__ = ["PrepareOptions"]


@dataclass(frozen=True, eq=False)
class PrepareOptions:
    """Every keyword of one prepare call, checked (see the module docstring for what is not).

    Attributes:
        layout: ``"auto"`` or a layout name (:data:`cpshard.names.LAYOUT_NAMES`).
        attention: ``"auto"`` or an attention method (:data:`cpshard.names.ATTENTION_CHOICES`).
        padding_token_id: Pad id for ``input_ids`` as given (checked with the batch).
        pad_multiple: Per-rank length multiple of the ``contiguous`` layout.
        loss_mask: Optional ``[B, S]`` loss mask, sharded into ``batch["loss_mask"]``.
        extra_token_keys: Caller-declared per-token keys.
        tp_mesh: Optional TP mesh handed to ``shard_batch``.
        check_consistency: Hash the batch's values into the cross-rank fingerprint.
        strict: Refuse token mixers that need the generic exact path.
        attention_cost: The cost model behind ``attention="auto"`` (``None``: its defaults).
        cp_sharder: A sharder to use as is (``make_cp_batch_and_ctx`` only).
        num_chunks: Passed to the model hook; ``None``: this call runs no model hook
            (``make_cp_batch_and_ctx``), an ``int >= 1`` for ``prepare_cp_forward``.
    """

    layout: LayoutName = "auto"
    attention: AttentionChoice = "auto"
    padding_token_id: int | None = 0
    pad_multiple: int = 1
    loss_mask: torch.Tensor | None = None
    extra_token_keys: Mapping[str, TokenKey] | None = None
    tp_mesh: DeviceMesh | None = None
    check_consistency: bool = True
    strict: bool = False
    attention_cost: CostModel | None = None
    cp_sharder: CPSharder | None = None
    num_chunks: int | None = None

    def problem(self) -> Exception | None:
        """The first invalid option as an exception to raise (what, the rule, the value given,
        the fix), or ``None``.

        Not raised here: the pipeline raises it on every rank after the one step header, whose
        batch fingerprint also carries these options, so an option given wrong on one rank only
        raises on every rank ("given different ...") instead of leaving the others waiting in
        the header's all-gather.

        Returns:
            ValueError: an unknown layout or attention name, ``num_chunks < 1``.
            TypeError: an ``attention_cost`` that is not a :class:`CostModel`, a ``cp_sharder``
                that is not a :class:`cpshard.CPSharder`.
        """
        if self.layout not in LAYOUT_NAMES:
            return ValueError(f"layout must be one of {LAYOUT_NAMES}, got layout={self.layout!r}")
        if self.num_chunks is not None and self.num_chunks < 1:
            return ValueError(f"num_chunks must be >= 1, got num_chunks={self.num_chunks}")
        if self.attention not in ATTENTION_CHOICES:
            return ValueError(
                f"attention must be one of {ATTENTION_CHOICES}, got attention={self.attention!r}"
            )
        if self.attention_cost is not None and not isinstance(self.attention_cost, CostModel):
            return TypeError(
                "attention_cost must be a cpshard.attention.cost.CostModel or None, got "
                f"{type(self.attention_cost).__name__}"
            )
        if self.cp_sharder is not None and not isinstance(self.cp_sharder, CPSharder):
            return TypeError(
                f"cp_sharder must be a cpshard.CPSharder or None, got "
                f"{type(self.cp_sharder).__name__}; build one with cpshard.CPSharder("
                "shard_batch=..., local_token_global_indices=...) or cpshard.closed_form_sharder"
            )
        return None

    @property
    def runs_model_hook(self) -> bool:
        """Whether this call runs the model's ``prepare_model_inputs_for_cp`` hook."""
        return self.num_chunks is not None

    def fingerprinted(self) -> dict[str, Any]:
        """The options the CP ranks must agree on, beside layout, attention and pad id.

        The batch fingerprint (:func:`cpshard.sharding.consistency.dispatch_fingerprint`) compares
        them across ranks: ``num_chunks`` for a call with a model hook, the given
        ``cp_sharder`` (by type) for one without.
        """
        out: dict[str, Any] = {
            "pad_multiple": self.pad_multiple,
            "loss_mask": self.loss_mask,
            "extra_token_keys": self.extra_token_keys,
            "strict": self.strict,
            "attention_cost": self.attention_cost,
        }
        if self.runs_model_hook:
            out["num_chunks"] = self.num_chunks
        else:
            out["cp_sharder"] = self.cp_sharder
        return out
