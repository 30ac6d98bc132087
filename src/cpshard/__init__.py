"""cpshard: context parallelism as one uniform, correct contract for PyTorch training loops.

See ``cpshard.prepare_cp_forward`` (with a model) and ``cpshard.make_cp_batch_and_ctx``.
"""

# Subpackages the README uses as ``cpshard.<name>.<fn>``: ``import cpshard`` is enough for them.
from cpshard import attention, consistency, loss
from cpshard.batch import TokenKey, attention_mask_to_padding_mask
from cpshard.batch_packed import packed_sharder
from cpshard.dispatch import closed_form_sharder, make_cp_batch_and_ctx, prepare_cp_forward
from cpshard.labels import shift_labels
from cpshard.layouts import (
    ContiguousLayout,
    NoneLayout,
    RoundRobinLayout,
    contiguous_local_indices,
    round_robin_local_indices,
)
from cpshard.loss import sync_grads
from cpshard.meta import TokenMeta
from cpshard.packing import PackSpec, shift_labels_packed
from cpshard.sharder import CPContext, CPSharder, ShardFacts

__all__ = [
    "CPContext",
    "CPSharder",
    "ContiguousLayout",
    "NoneLayout",
    "PackSpec",
    "RoundRobinLayout",
    "ShardFacts",
    "TokenKey",
    "TokenMeta",
    "attention",
    "attention_mask_to_padding_mask",
    "closed_form_sharder",
    "consistency",
    "contiguous_local_indices",
    "loss",
    "make_cp_batch_and_ctx",
    "packed_sharder",
    "prepare_cp_forward",
    "round_robin_local_indices",
    "shift_labels",
    "shift_labels_packed",
    "sync_grads",
]
