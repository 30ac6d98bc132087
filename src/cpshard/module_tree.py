"""One walk of a model's module tree per prepare, and what the prepare's checks derive from it.

Every prepare checks the model: which modules mix tokens outside attention
(:func:`cpshard.mixers.find_token_mixers`), the names, shapes and dtypes of its parameters and
buffers (:func:`cpshard.guards.step.model_fingerprint`), HF gradient checkpointing
(:func:`cpshard.guards.model.check_gradient_checkpointing`). Each walked the whole tree on its
own, on every prepare: ~9 ms for a 32-layer HF decoder (~420 modules), twice the rest of the
prepare. A training loop prepares the same model every step, and its tree does not change.

:class:`ModuleTree` is that walk, kept by the model's guard between prepares. :meth:`ModuleTree.of`
re-reads what the tree is made of (each module's class, and the names and identities of its
children, parameters and buffers: :func:`cpshard._compat.member_signature`, ~0.3 ms at 420
modules) and walks again only where any of it changed. What the checks derive from the structure
alone is kept in :meth:`ModuleTree.memo`, under a key of whatever else the derivation read (the
config's layer types, attribute values); per-call state (values, shapes, dtypes, ``training``,
flags) is read on every prepare.

Nothing here keeps the model or its tensors alive: the modules are held by weak reference, and a
module that died (so its id may be reused) makes the next :meth:`ModuleTree.of` walk again. The
memo holds no tensor, not even weakly (``torch.utils.swap_tensors``, which ``nn.Module.to`` uses
for DTensor parameters, refuses a tensor with a weak reference): a consumer keeps where a tensor
sits (module index and name) and reads it from its module.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from torch import nn

from cpshard import _compat

__all__ = ["ModuleTree"]

_T = TypeVar("_T")


class ModuleTree:
    """``named_modules()`` of one model (pre-order, each module once, at its first name), and the
    memo of facts derived from it.

    Made by :meth:`of`. Holds the modules by weak reference only (it is kept on the model's
    guard: a strong one would keep a replaced module alive until the next prepare).
    """

    def __init__(self, model: nn.Module) -> None:
        walk = list(model.named_modules())
        self.names: list[str] = [name for name, _ in walk]
        self._root = weakref.ref(model)
        self._refs = [weakref.ref(m) for _, m in walk]
        self._signature = _compat.member_signature([m for _, m in walk])
        self._memo: dict[str, tuple[Hashable, Any]] = {}

    @classmethod
    def of(cls, model: nn.Module, kept: ModuleTree | None) -> ModuleTree:
        """``kept`` where it still describes ``model``'s tree, else a fresh walk.

        Args:
            model: The model.
            kept: The tree of an earlier prepare of ``model`` (``None``: none).

        Returns:
            A tree whose :meth:`modules` are ``model``'s now (``kept`` with its memo, or new).
        """
        if kept is None or kept._root() is not model:
            return cls(model)
        modules = [r() for r in kept._refs]
        # a dead module: its id may now name another object, so the ids compared below may lie
        if any(m is None for m in modules):
            return cls(model)
        if _compat.member_signature(modules) != kept._signature:  # type: ignore[arg-type]
            return cls(model)
        return kept

    def modules(self) -> list[nn.Module]:
        """The walk's modules, in order (``self.names[i]`` is ``modules()[i]``'s name): strong
        references for the caller, made from the tree's weak ones on each call.

        Raises:
            RuntimeError: a module of the walk died since :meth:`of` returned this tree (read
                the tree in the call that made it).
        """
        modules = [r() for r in self._refs]
        if any(m is None for m in modules):
            raise RuntimeError(
                "a module of this ModuleTree was freed since ModuleTree.of returned it: make "
                "the tree again with ModuleTree.of(model, tree) before reading it"
            )
        return modules  # type: ignore[return-value]

    def memo(self, what: str, key: Hashable, make: Callable[[], _T]) -> _T:
        """``make()``, or its value from an earlier call with the same ``what`` and ``key`` on
        this tree (an unchanged structure).

        Args:
            what: Which fact (one per consumer).
            key: Everything else ``make`` reads that can change without the tree changing
                (compared with ``==``; must not hold a module or a tensor).
            make: Derives the fact from this tree (its value must not hold a module or a
                tensor: use indices into :meth:`modules`, or weak references).
        """
        got = self._memo.get(what)
        if got is not None and got[0] == key:
            value: _T = got[1]
            return value
        value = make()
        self._memo[what] = (key, value)
        return value
