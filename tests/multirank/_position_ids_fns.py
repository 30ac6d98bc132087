"""Rank functions: dense rows with any ``position_ids`` (gaps, repeats, a 0 mid-row, arbitrary
values), with or without an ``attention_mask``, under CP == the HF model in one process.

transformers reads ``position_ids`` two ways: with an ``attention_mask`` they are RoPE positions
of one causal row; without one (and without a KV cache, as in training: ``use_cache=False``)
its masks start a new sequence wherever they do not step by +1
(``find_packed_sequence_indices``). cpshard must do the same, never refuse.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.testing import assert_close

import cpshard
from cpshard.loss import count_tokens, cp_cross_entropy

VOCAB = 40
FAMILIES = ("arange", "offset", "gaps", "repeats", "zero_mid", "random", "shared")
MASKS = ("none", "ones", "left", "right")


def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
        max_position_embeddings=256, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).double()


def _positions(family: str, rows: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, seq]`` (``[1, seq]`` for ``shared``) position_ids of one family."""

    def rand(lo: int, hi: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=gen)

    base = torch.arange(seq).expand(rows, seq)
    if family == "arange":
        return base.clone()
    if family == "offset":
        return base + rand(1, 9, (rows, 1))
    if family in ("gaps", "repeats"):
        steps = torch.ones(rows, seq, dtype=torch.long)
        jump = torch.rand(rows, seq, generator=gen) < 0.3
        steps[jump] = rand(2, 6, (rows, seq))[jump] if family == "gaps" else 0
        steps[:, 0] = 0
        return steps.cumsum(1)
    if family == "zero_mid":
        pos = base + rand(0, 4, (rows, 1))
        for b in range(rows):
            cut = int(rand(1, seq, (1,)))
            pos[b, cut:] = torch.arange(seq - cut)
        return pos
    if family == "random":
        return rand(0, seq, (rows, seq))
    return (base[:1] + rand(0, 3, (1, 1))).masked_fill(torch.rand(1, seq, generator=gen) < 0.2, 0)


def example(seed: int) -> tuple[str, str, dict[str, torch.Tensor]]:
    """One random example: ``(family, mask kind, batch)``; the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    family = FAMILIES[seed % len(FAMILIES)]
    kind = MASKS[(seed // len(FAMILIES)) % len(MASKS)]
    rows = int(torch.randint(1, 4, (1,), generator=gen))
    seq = int(torch.randint(4, 19, (1,), generator=gen))
    batch = {
        "input_ids": torch.randint(1, VOCAB, (rows, seq), generator=gen),
        "position_ids": _positions(family, rows, seq, gen),
    }
    if kind != "none":
        mask = torch.ones(rows, seq, dtype=torch.long)
        if kind != "ones":
            real = torch.randint(1, seq + 1, (rows,), generator=gen)
            keep = torch.arange(seq)[None] < real[:, None]
            mask = (keep.flip(1) if kind == "left" else keep).long()
        batch["attention_mask"] = mask
    pad = None if kind == "none" else batch["attention_mask"] == 0
    batch["labels"] = cpshard.shift_labels(batch["input_ids"], padding_mask=pad)
    return family, kind, batch


def positions_match_one_process(cp_mesh: DeviceMesh, seeds: list[int]) -> dict[str, int]:
    """Every example: logits at real tokens and every gradient equal the HF model's without CP.

    Returns:
        How many examples of each ``family/mask`` ran (none is refused).
    """
    ran: dict[str, int] = {}
    ref, model = _model(), _model()
    for seed in seeds:
        family, kind, batch = example(seed)
        ref.zero_grad()
        model.zero_grad()
        labels = batch["labels"]
        n = count_tokens(labels)
        hf = {k: v for k, v in batch.items() if k != "labels"}
        want = ref(**hf).logits
        if n:
            cp_cross_entropy(want, labels, num_tokens=n).backward()
        ctx, local, sharder = cpshard.prepare_cp_forward(model, cp_mesh, batch)
        with ctx():
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        if n:
            cp_cross_entropy(logits, local["labels"], num_tokens=n).backward()
            cpshard.sync_grads(model, cp_mesh)
        fill = 0.0 if sharder.input_token_stream_positions is not None else None
        got = sharder.gather_token_tensor(logits.detach(), trim=True, fill=fill)
        real = batch.get("attention_mask", torch.ones_like(labels)).bool()
        where = f"seed {seed}: {family}/{kind} {batch['position_ids'].tolist()}"
        assert_close(got[real], want.detach()[real], msg=where)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            if n:
                assert p.grad is not None and q.grad is not None, name
                assert_close(p.grad, q.grad, msg=f"{where} {name}")
        ran[f"{family}/{kind}"] = ran.get(f"{family}/{kind}", 0) + 1
    return ran
