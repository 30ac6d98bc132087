"""The packed shard's two ways of taking a rank's tokens agree: slices of the caller's rows per
piece of its runs (coarse pieces) and one ``index_select`` of its caller indices (fine ones),
for every key kind, layout, CP size and rank, values and gradients."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import cpshard
from cpshard.layouts.balanced import plan_balanced
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.packed import plan_packed
from cpshard.sharding import packed as packed_shard


class _RankOf:
    """Stands for a CP mesh of ``world`` ranks seen from ``rank`` (all the shard asks of it)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.world


def _spec(rng: random.Random, rows: int, row_len: int) -> PackSpec:
    """Rows of long documents with a few of one token, some rows ending in padding."""
    out = []
    for _ in range(rows):
        left = row_len - rng.choice([0, rng.randint(0, row_len // 3)])
        row = []
        while left > 0:
            n = min(left, rng.choice([1, rng.randint(20, row_len)]))
            row.append(n)
            left -= n
        out.append(row)
    return PackSpec.from_seq_lens(out, row_len)


def _shard(
    monkeypatch: pytest.MonkeyPatch, coarse: int, rank: int, world: int, layout: str,
    batch: dict[str, Any], **kw: Any,
) -> dict[str, Any]:  # fmt: skip
    monkeypatch.setattr(packed_shard, "_COARSE_PIECES", coarse)
    mesh: Any = _RankOf(rank, world)
    _, out = packed_shard.shard_batch_packed(mesh, None, batch, layout=layout, **kw)
    return out


@pytest.mark.parametrize("layout", ["balanced", "packed"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pieces_and_indices_give_the_same_shard(
    monkeypatch: pytest.MonkeyPatch, layout: str, world: int
) -> None:
    rng = random.Random(world * 10 + len(layout))
    extra = {"adv": cpshard.TokenKey(1, 0.5), "tr": cpshard.TokenKey(0, 9.0)}
    extra["one_row"] = cpshard.TokenKey(1, -2)
    taken = 0
    for case in range(6):
        spec = _spec(rng, rng.randint(1, 3), rng.randint(60, 200))
        if spec.real_tokens < world:
            continue
        bsz, seq = spec.num_rows, spec.row_len
        g = torch.Generator().manual_seed(case)
        ids = torch.randint(1, 1000, (bsz, seq), generator=g)
        emb = torch.randn(bsz, seq, 3, generator=g, dtype=torch.float64)
        base = {
            "input_ids": ids,
            "labels": ids.roll(-1, 1),
            "adv": torch.randn(bsz, seq, generator=g),
            "tr": torch.randn(seq, bsz, generator=g),
            "one_row": torch.arange(seq)[None],  # one row for every row
            "seq_lens": [list(r) for r in spec.doc_lens],
        }
        # documents from restarting positions: the layout pads continue their document
        from_positions = {"input_ids": ids, "position_ids": spec.position_ids()}
        plan = (plan_balanced if layout == "balanced" else plan_packed)(spec, world)
        for rank in range(world):
            monkeypatch.setattr(packed_shard, "_COARSE_PIECES", 1)
            local = packed_shard._local_pieces(plan, rank)
            if local is not None and local[2] is not None:
                taken += 1
            for batch, kw in ((base, {"extra_token_keys": extra}), (from_positions, {})):
                got = _shard(monkeypatch, 1, rank, world, layout, batch, **kw)
                want = _shard(monkeypatch, 1 << 40, rank, world, layout, batch, **kw)
                assert got.keys() == want.keys()
                for key, value in want.items():
                    if isinstance(value, torch.Tensor):
                        assert torch.equal(got[key], value), (key, rank)
                        assert got[key].is_contiguous(), key
            # gradients reach the caller's embeddings alike
            grads = []
            for coarse in (1, 1 << 40):
                leaf = emb.clone().requires_grad_()
                batch = {"inputs_embeds": leaf, "seq_lens": base["seq_lens"]}
                out = _shard(monkeypatch, coarse, rank, world, layout, batch)
                w = torch.arange(out["inputs_embeds"].numel(), dtype=torch.float64)
                (out["inputs_embeds"] * w.view_as(out["inputs_embeds"])).sum().backward()
                grads.append(leaf.grad)
            torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert taken  # the pieces' path ran


def test_coarse_pieces_are_taken_at_scale() -> None:
    """A realistic packed batch (a few long documents per row) is sharded from pieces on every
    rank without any setting; their slots tile the rank's slots. Fine pieces give the caller
    indices instead, equal to the plan's."""
    rng = random.Random(3)
    spec = _spec(rng, 4, 32768)
    for world in (2, 4):
        plan = plan_balanced(spec, world)
        for rank in range(world):
            got = packed_shard._local_pieces(plan, rank)
            assert got is not None
            positions, pad, pieces, src = got
            assert pieces is not None and src is None
            first, count, is_pad = pieces
            assert sum(count) == plan.local_len == positions.numel() == pad.numel()
            mine = plan.rank_map[rank]
            assert torch.equal(positions, plan.stream_position_ids[mine])
            assert torch.equal(pad, plan.stream_padding_mask[mine])
            src = plan.stream_input_sources[mine]
            at = 0
            for f, n, p in zip(first, count, is_pad, strict=True):
                part = src[at : at + n]
                want = torch.full((n,), -1) if p else torch.arange(f, f + n)
                assert torch.equal(part, want)
                at += n
    fine = plan_packed(_spec(rng, 2, 300), 4)  # TE: every document in 8 chunks
    for rank in range(4):
        got = packed_shard._local_pieces(fine, rank)
        assert got is not None and got[2] is None and got[3] is not None
        assert torch.equal(got[3], fine.stream_input_sources[fine.rank_map[rank]])
