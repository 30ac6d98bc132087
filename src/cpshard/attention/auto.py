"""``attention="auto"`` at the dispatcher: one method per batch, from the cost model.

The dispatcher shards a batch before the model runs, so it does not know the model's head counts:
it models the call with the heads, head dim and dtype of its
:class:`~cpshard.attention.cost.CostModel` (settable; defaults are a Llama-3-8B-like bf16 layer)
and chooses among the methods that serve *every* head count at this CP size (so never
``ulysses`` at ``cp > 1``: its check depends on the heads; :func:`cpshard.attention.cp_sdpa` with
``method="auto"``, which sees the heads, may pick it). The choice is recorded on the batch
(``ctx.facts.attention_method``, with every method's modelled cost in
``ctx.facts.token_meta.plan_cache["attention_costs"]``) and logged at INFO when it differs from
the previous batch's choice on the same CP mesh.

The decision reads only global facts (the token meta every rank holds), so every rank makes the
same choice without a collective.

The log memo (last choice per CP mesh, weakly keyed) is the one piece of state that outlives a
batch here; it decides nothing but whether a log line is written.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import logging
import weakref

from torch.distributed.device_mesh import DeviceMesh

from cpshard.attention.cost import CostModel, choose_method, plan_facts
from cpshard.attention.methods import servable
from cpshard.sharding.meta import TokenMeta

__all__ = ["CHOICE_KEY", "COSTS_KEY", "choose_for_batch"]

logger = logging.getLogger("cpshard.attention")

CHOICE_KEY = "attention_method"
"""``meta.plan_cache`` key of the dispatcher's method for the batch (read by ``ShardFacts``)."""
COSTS_KEY = "attention_costs"
"""``meta.plan_cache`` key of every method's modelled seconds for the batch."""

_last_logged: weakref.WeakKeyDictionary[DeviceMesh, str] = weakref.WeakKeyDictionary()


def choose_for_batch(
    meta: TokenMeta,
    cp_mesh: DeviceMesh | None,
    cost_model: CostModel | None = None,
    *,
    outer: bool = False,
) -> str:
    """The method ``attention="auto"`` runs for this batch (recorded on ``meta``, logged on change).

    Args:
        meta: Token meta of the sharded batch (for a 2-D CP mesh: the merged meta the outer
            method runs on, :func:`cpshard.attention.hybrid.merged_meta`).
        cp_mesh: The CP mesh (the log memo's key), or ``None``.
        cost_model: Rates and the assumed call shape; ``None`` -> :class:`CostModel` defaults.
        outer: Choose the outer method of a 2-D CP mesh (never ``ulysses``).

    Returns:
        A method name of :data:`cpshard.names.METHOD_NAMES`.
    """
    model = CostModel() if cost_model is None else cost_model
    rows = int(meta.positions.shape[0])
    facts = plan_facts(meta, True, None, blocks=model.needs_blocks())
    # Only methods that serve every head count: the model's heads are not known here.
    candidates = servable(1, 1, meta.world_size, outer)
    best, costs = choose_method(facts, model.shape(rows), model, candidates)
    meta.plan_cache[CHOICE_KEY] = best
    meta.plan_cache[COSTS_KEY] = dict(costs)
    if cp_mesh is not None and _last_logged.get(cp_mesh) != best:
        _last_logged[cp_mesh] = best
        logger.info(
            "cpshard attention='auto' chose %s at cp=%d (modelled ms per layer: %s)",
            best, meta.world_size, ", ".join(f"{k}={v * 1e3:.3g}" for k, v in costs.items()),
        )  # fmt: skip
    return best
