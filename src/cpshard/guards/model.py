"""Call-time guards on a CP-prepared model: the sharded batch runs inside its own ``ctx()``.

:func:`cpshard.prepare_cp_forward` installs one forward pre-hook and one forward hook on the
model (:func:`install_model_guard`: idempotent, the public ``register_forward_pre_hook`` /
``register_forward_hook`` API; nothing is patched). On every forward it checks, from facts
the call itself carries (the local batch tensors carry the identity of the shard that made them):

* a local batch tensor reaches the model *outside* ``ctx()`` (or inside
  :func:`cpshard.attention.suspend`): attention would silently be shard-local -> ``ValueError``;
* inside ``ctx()``, a local tensor of *another* batch (a stale ctx, or a ctx of a newer batch)
  -> ``ValueError``;
* inside ``ctx()``, a sharded batch without ``position_ids`` (when the forward takes them): the
  model would number the local tokens ``0..L-1`` -> ``ValueError`` with the fix;
* inside ``ctx()``, ``labels`` handed to the model: an HF model would shift the pre-shifted labels
  again and average over the local tokens only -> ``ValueError`` with the fix;
* inside ``ctx()``, an ``attention_mask`` handed to the model: it would be ignored (padding
  reaches CP attention through the sharded batch) -> ``ValueError`` with the fix.

Calls on unsharded tensors outside ``ctx()`` (evaluation, generation) are not affected.

HF gradient checkpointing is checked at prepare and again at every forward under ``ctx()`` (it
may be enabled after the prepare): its recomputation runs in ``backward()``, outside
any CP context, so it must be non-reentrant with
``context_fn=cpshard.attention.checkpoint_context_fn`` (else attention would be recomputed as local
attention: silently wrong gradients) -> ``ValueError`` with the fix.

Whether every rank ran every phase of its step (an exception caught inside the forward, a
skipped backward or ``sync_grads``) is the step record's job (:mod:`cpshard.guards.step`).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from cpshard import _comm, _compat
from cpshard.attention.context import active_mode, checkpoint_context_fn
from cpshard.attention.hf import (
    ATTENTION_NAME,
    check_cp_attention_support,
    interface_attention_modules,
)
from cpshard.attention.hf_options import document_positions
from cpshard.module_tree import ModuleTree
from cpshard.sharding.facts import batch_tag, call_record_tensors, matches_record, same_shard
from cpshard.sharding.meta import TokenMeta

__all__ = ["check_gradient_checkpointing", "install_model_guard", "remember_shard"]

_LOSS_FIX = (
    "compute the loss from the logits with the global token count instead, e.g. "
    "loss = cpshard.loss.cp_cross_entropy(logits, local['labels'], "
    "num_tokens=cpshard.loss.count_tokens(batch['labels']))"
)


class _ModelGuard:
    """The forward pre/post hooks of one prepared model."""

    def __init__(self, hf: bool) -> None:
        self.in_flight = False  # a forward under a multi-rank ctx() started and did not finish
        self.hf = hf  # an HF model whose attention cpshard switches inside ctx()
        self.calls: list[int] = []  # CP attention calls seen at each open attention module
        self.last_meta: TokenMeta | None = None  # the token meta of the last prepared batch
        self.tree: ModuleTree | None = None  # the model's module tree at its last prepare

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        _check_call(module, args, kwargs)
        _check_copies(module, args, kwargs, self.last_meta)
        if self.hf and not kwargs.get("_pre_embed_only"):
            _check_switched(module)
        mode = active_mode()
        if mode is not None and module.training:  # enabled after prepare: checked here too
            check_gradient_checkpointing(module)
        if mode is not None and mode.group is not None:
            self.in_flight = True

    def post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self.in_flight = False

    def attention_pre(self, module: nn.Module, args: Any) -> None:
        """Before an attention module: remember the context's CP attention count."""
        mode = active_mode()
        self.calls.append(-1 if mode is None else mode.attention_calls)

    def attention_post(self, module: nn.Module, args: Any, output: Any) -> None:
        """After it: under ctx() with cpshard selected, it must have called CP attention.

        The backstop for an attention that bypassed the registry in this call (a branch of its
        own, e.g. an alibi path). Every rank runs the same modules in the same order, so every
        rank raises here, at the same module, before any later collective.
        """
        before = self.calls.pop() if self.calls else -1
        mode = active_mode()
        if mode is None or before < 0 or mode.attention_calls > before:
            return
        config = getattr(module, "config", None)
        if _compat.attn_implementation(config) != ATTENTION_NAME:
            return
        self.in_flight = False  # every rank stops here: nothing is left in flight
        raise ValueError(
            f"{type(module).__name__} ran inside ctx() without calling cpshard's CP attention "
            "(it computed attention on a path of its own, over this rank's shard only: silently "
            "wrong). This model (or this configuration of it, e.g. alibi) cannot run under "
            "cpshard CP; train it without cpshard (cp=1, no prepare_cp_forward) or configure "
            "it so that its attention goes through transformers' AttentionInterface"
        )


def _check_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if kwargs.get("_pre_embed_only"):  # the dispatcher's model-hook call
        return
    tags = [t for t in (batch_tag(v) for v in (*args, *kwargs.values())) if t is not None]
    mode = active_mode()
    if mode is None:
        if tags:
            raise ValueError(
                f"{type(module).__name__} was prepared for CP and called on a sharded batch "
                "outside its ctx(): attention would only see this rank's shard (silently wrong "
                "at cp > 1). Run the forward inside the context: `with ctx(): "
                "out = model(**local)`"
            )
        return
    if not all(same_shard(t, mode.meta) for t in tags):
        raise ValueError(
            f"{type(module).__name__} got a local tensor of another batch than the one its "
            "ctx() was made for; use the ctx returned together with this batch"
        )
    if kwargs.get("labels") is not None:
        raise ValueError(
            f"{type(module).__name__} got `labels` inside ctx(): its own loss would shift the "
            "(already shifted) labels again and average over this rank's tokens only. Do not "
            f"pass labels to the model under CP; {_LOSS_FIX}"
        )
    if kwargs.get("attention_mask") is not None:
        raise ValueError(
            f"{type(module).__name__} got an `attention_mask` inside ctx(), which CP attention "
            "cannot use (masks come from the sharded batch's token meta). Put the padding in the "
            "batch given to prepare_cp_forward (attention_mask or padding_mask) and call the "
            "model without it, e.g. model(input_ids=local['input_ids'], "
            "position_ids=local['position_ids'])"
        )
    if tags and _omits_position_ids(module, args, kwargs):
        raise ValueError(
            f"{type(module).__name__} got a sharded batch inside ctx() without `position_ids`: "
            "it would number this rank's tokens 0..L-1 (RoPE / position embeddings silently "
            "wrong, for packed rows at cp=1 too). Pass the sharded batch's global positions, "
            "e.g. model(input_ids=local['input_ids'], position_ids=local['position_ids'])"
        )


def _position_tables(model: nn.Module) -> list[nn.Embedding]:
    """Learned absolute-position tables of an HF model (config facts + module structure).

    An ``nn.Embedding`` (or subclass) whose size is the config's ``max_position_embeddings``
    (plus an offset of at most 4, as BART's 2) and not the vocabulary size.
    """
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    max_pos = getattr(text, "max_position_embeddings", None)
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(max_pos, int):
        return []
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.Embedding)
        and m.num_embeddings != vocab
        and 0 <= m.num_embeddings - max_pos <= 4
    ]


def _position_offset(table: nn.Embedding, model: nn.Module) -> int:
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    return int(table.num_embeddings - getattr(text, "max_position_embeddings", 0))


def _check_position_table(offset: int, module: nn.Module, args: Any, output: Any) -> None:
    """Under ctx(): a position table must have looked up the tokens' document positions.

    Models that number positions from a local ``arange`` (e.g. BART-style decoders that do not
    take ``position_ids``) would embed local indices: silently wrong under CP (and for packed
    rows). The verdict is all-reduced over the CP group (every rank runs this table at the same
    point of the forward), so every rank raises together.
    """
    mode = active_mode()
    if mode is None or not isinstance(output, torch.Tensor) or not isinstance(module, nn.Embedding):
        return
    meta = mode.meta
    n = meta.local_len
    if output.dim() < 2 or output.shape[-2] != n:
        return  # not a lookup over this shard's tokens
    rows = output.detach().reshape(-1, n, output.shape[-1])
    lo = meta.rank * n
    pos = document_positions(meta)[:, lo : lo + n].to(rows.device)
    real = (meta.document_ids[:, lo : lo + n] >= 0).to(rows.device)
    weight = module.weight.detach()
    # The table's own numbering: RoBERTa-style tables (a padding row) start at padding_idx + 1,
    # the others at the rows they hold beyond max_position_embeddings (BART, OPT: 2).
    offsets = {offset if module.padding_idx is None else module.padding_idx + 1}
    ok = False
    for off in sorted(offsets):
        idx = (pos + off).clamp(max=module.num_embeddings - 1)
        want = weight[idx].expand(rows.shape[0], -1, -1)
        mask = real.expand(rows.shape[0], -1)
        if torch.equal(rows[mask], want[mask]):
            ok = True
            break
    bad = torch.tensor([0 if ok else 1], dtype=torch.int64, device=rows.device)
    if mode.group is not None:
        _comm.all_reduce_sum_(bad, mode.group)
    if int(bad.item()):
        raise ValueError(
            f"{type(module).__name__} (a learned position table) did not embed the tokens' "
            "positions inside ctx() as the model numbers them on its own: it numbers positions "
            "from a local arange instead of the position_ids it is given, or numbers them "
            "differently (e.g. from padding_idx + 1) from cpshard's 0-based position_ids "
            "(silently wrong under CP and for packed rows). This model cannot run under "
            "cpshard CP; train it without cpshard (cp=1, dense rows, no prepare_cp_forward)"
        )


def _check_switched(model: nn.Module) -> None:
    """Inside ctx() an HF model must run with cpshard's attention selected."""
    mode = active_mode()
    if mode is None:
        return
    config = getattr(model, "config", None)
    impl = _compat.attn_implementation(config, ATTENTION_NAME)
    if impl != ATTENTION_NAME:
        raise ValueError(
            f"{type(model).__name__} runs inside ctx() with attn_implementation={impl!r}, not "
            f"{ATTENTION_NAME!r}: its attention would only see this rank's shard (silently "
            "wrong). Do not change the attention implementation inside ctx(); call the model "
            "inside the ctx() returned by prepare_cp_forward for it"
        )


def _check_copies(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], last: TokenMeta | None
) -> None:
    """The tag checks of :func:`_check_call` for local tensors that lost their tag (``.clone()``,
    ``.to()``): their ``input_ids`` / ``position_ids`` are compared with the shard's record
    (shape and content hash; only for untagged tensors, so the plain path hashes nothing)."""
    if kwargs.get("_pre_embed_only"):
        return
    tensors = call_record_tensors(module, args, kwargs)
    if not tensors:
        return
    mode = active_mode()
    if mode is not None:
        if matches_record(mode.meta.local_record, tensors) is False:
            raise ValueError(
                f"{type(module).__name__} got input_ids / position_ids inside ctx() that are not "
                "the local batch this ctx() was made for (another batch, or another shape; "
                "copies of the right batch are fine): a stale ctx. Use the ctx returned together "
                "with this batch"
            )
        return
    if last is not None and last.world_size > 1 and matches_record(last.local_record, tensors):
        raise ValueError(
            f"{type(module).__name__} was prepared for CP and called outside its ctx() on a copy "
            "(e.g. .clone() / .to()) of its last sharded batch: attention would only see this "
            "rank's shard (silently wrong at cp > 1). Run the forward inside the context: "
            "`with ctx(): out = model(**local)`"
        )


def remember_shard(model: nn.Module, meta: TokenMeta | None) -> None:
    """Give the model's guard the token meta of the batch just prepared for it."""
    for hook in _compat.forward_pre_hooks(model):
        guard = getattr(hook, "__self__", None)
        if isinstance(guard, _ModelGuard):
            guard.last_meta = meta


def _omits_position_ids(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``module``'s forward takes ``position_ids`` and this call leaves it ``None``."""
    if kwargs.get("position_ids") is not None:
        return False
    try:
        sig = inspect.signature(module.forward)
        bound = sig.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return "position_ids" in sig.parameters and bound.arguments.get("position_ids") is None


def _checkpointing_flag(module: nn.Module, answers: dict[type, bool]) -> object:
    """``getattr(module, "gradient_checkpointing", False)`` without the miss path of
    ``nn.Module.__getattr__``: the instance's own value, else ``getattr`` only where the class
    can answer (:func:`cpshard._compat.class_answers`, asked once per class of one walk:
    ``answers``)."""
    own = module.__dict__
    if "gradient_checkpointing" in own:
        return own["gradient_checkpointing"]
    cls = type(module)
    can = answers.get(cls)
    if can is None:
        can = answers[cls] = _compat.class_answers(cls, "gradient_checkpointing")
    return getattr(module, "gradient_checkpointing", False) if can else False


def check_gradient_checkpointing(model: nn.Module, tree: ModuleTree | None = None) -> None:
    """Raise unless HF gradient checkpointing (if enabled) recomputes under the CP context.

    Args:
        model: The model.
        tree: ``model``'s module tree of this call (``None``: walk ``named_modules()``).

    Raises:
        ValueError: a module checkpoints with the reentrant variant, or without
            ``context_fn=cpshard.attention.checkpoint_context_fn``.
    """
    walk = model.named_modules() if tree is None else zip(tree.names, tree.modules(), strict=True)
    answers: dict[type, bool] = {}
    for name, module in walk:
        if _checkpointing_flag(module, answers) is not True or not module.training:
            continue  # HF checkpoints only in training mode (eval / log-prob passes are fine)
        func = _compat.gradient_checkpointing_func(module)
        if func is None:
            continue
        kwargs = func.keywords if isinstance(func, functools.partial) else {}
        if kwargs.get("use_reentrant", True) is not False:
            problem = "uses reentrant checkpointing, whose recomputation cannot see the CP context"
        elif kwargs.get("context_fn") is not checkpoint_context_fn:
            problem = "checkpoints without cpshard's recompute context"
        else:
            continue
        raise ValueError(
            f"{type(model).__name__} has gradient checkpointing enabled (module "
            f"{name or type(module).__name__!r}) and {problem}: backward() would recompute "
            "attention as local attention of this rank's shard (silently wrong gradients under "
            "CP). Enable it as model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
            "{'use_reentrant': False, 'context_fn': cpshard.attention.checkpoint_context_fn})"
        )


def install_model_guard(model: nn.Module, cp_size: int) -> ModuleTree:
    """Register the call-time guard on ``model`` once.

    Returns:
        ``model``'s module tree of this prepare: the one the guard kept from the last prepare
        where the tree is unchanged (with its memo), else a fresh walk; the guard keeps it.

    Raises:
        ValueError: HF gradient checkpointing that would recompute attention outside CP (see
            :func:`check_gradient_checkpointing`); an HF model whose attention does not run
            through cpshard's registered attention
            (:func:`cpshard.attention.hf.check_cp_attention_support`).
    """
    for hook in _compat.forward_pre_hooks(model):
        guard = getattr(hook, "__self__", None)
        if isinstance(guard, _ModelGuard):
            guard.tree = ModuleTree.of(model, guard.tree)
            check_gradient_checkpointing(model, guard.tree)
            return guard.tree
    tree = ModuleTree.of(model, None)
    check_gradient_checkpointing(model, tree)
    hf = hasattr(model, "set_attn_implementation") and not hasattr(
        model, "prepare_model_inputs_for_cp"
    )
    if hf:  # before any collective, the same verdict on every rank
        check_cp_attention_support(model)
    guard = _ModelGuard(hf)
    model.register_forward_pre_hook(guard.pre, with_kwargs=True)
    model.register_forward_hook(guard.post, with_kwargs=True)
    if hf:
        for attention in interface_attention_modules(model):
            attention.register_forward_pre_hook(guard.attention_pre)
            attention.register_forward_hook(guard.attention_post)
        for table in _position_tables(model):
            offset = _position_offset(table, model)
            table.register_forward_hook(functools.partial(_check_position_table, offset))
    guard.tree = tree
    return tree
