"""cpshard: context parallelism as one uniform, correct contract for PyTorch training loops.

See ``cpshard.prepare_cp_forward`` (with a model) and ``cpshard.make_cp_batch_and_ctx``.

Owns the public face only: it re-exports the names the README uses from the core (layouts,
sharding, guards, attention, dispatch, loss), so ``import cpshard`` loads no tool, command or
example model (``cpshard.models`` and ``cpshard.launch`` are imported by name). The folders and
the arrows between them: ARCHITECTURE.md.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

# Subpackages the README uses as ``cpshard.<name>.<fn>``: ``import cpshard`` is enough for them.
from cpshard import attention, loss
from cpshard._version import __version__
from cpshard.dispatch import closed_form_sharder, make_cp_batch_and_ctx, prepare_cp_forward
from cpshard.layouts.closed_form import (
    ContiguousLayout,
    NoneLayout,
    RoundRobinLayout,
    contiguous_local_indices,
    round_robin_local_indices,
)
from cpshard.layouts.documents import PackSpec
from cpshard.loss import sync_grads
from cpshard.sharding import consistency
from cpshard.sharding.batch import TokenKey, attention_mask_to_padding_mask
from cpshard.sharding.labels import shift_labels, shift_labels_packed
from cpshard.sharding.meta import TokenMeta
from cpshard.sharding.packed import packed_sharder
from cpshard.sharding.sharder import CPContext, CPSharder, ShardFacts
from cpshard.sharding.toolkit import (
    Placement,
    facts_from_placement,
    normalize_batch,
    pad_tokens,
    pad_value,
)

__all__ = [
    "CPContext",
    "CPSharder",
    "ContiguousLayout",
    "NoneLayout",
    "PackSpec",
    "Placement",
    "RoundRobinLayout",
    "ShardFacts",
    "TokenKey",
    "TokenMeta",
    "__version__",
    "attention",
    "attention_mask_to_padding_mask",
    "closed_form_sharder",
    "consistency",
    "contiguous_local_indices",
    "facts_from_placement",
    "loss",
    "make_cp_batch_and_ctx",
    "normalize_batch",
    "packed_sharder",
    "pad_tokens",
    "pad_value",
    "prepare_cp_forward",
    "round_robin_local_indices",
    "shift_labels",
    "shift_labels_packed",
    "sync_grads",
]
