"""A NaN / inf in one document of a packed batch stays in that document: the other documents'
outputs and gradients equal one process running each document alone (no NaN anywhere), at cp=1
(layout none) and cp=2/3, for every method; the bad document itself still shows the NaN."""

from __future__ import annotations

import pytest
import torch
from _nan_fns import (
    BAD_SLOT,
    attention_reference,
    attention_with_nan_case,
    bad_token,
    decoder_alone_reference,
    decoder_with_nan_case,
    documents,
)

from _ranks import Ranks
from cpshard.names import METHOD_NAMES

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_nan_in_one_document_stays_there_in_a_model(ranks: Ranks, method: str, world: int) -> None:
    """TinyDecoder (2 layers, GQA) on a packed batch, a NaN (inf for the ring) in one token's
    embedding: every other document's logits and embedding grads, in both rows, are exact."""
    layout = "auto"  # packed: balanced at every CP size (cp=1 included)
    value = float("inf") if method == "ring" else float("nan")
    want = decoder_alone_reference()
    bad_row, bad_col = bad_token()
    for logits, grad in ranks(world, decoder_with_nan_case, method, layout, value):
        for (row, start, n), (ref_logits, ref_grad) in zip(documents(), want, strict=True):
            got_l, got_g = logits[row, start : start + n], grad[row, start : start + n]
            if row == bad_row and start <= bad_col < start + n:
                assert got_l.isnan().any() and got_g.isnan().any()  # not silently finite
                continue
            where = f"row {row} document at {start}"
            torch.testing.assert_close(got_l, ref_logits, msg=lambda m, w=where: f"{w}: {m}")
            torch.testing.assert_close(got_g, ref_grad, msg=lambda m, w=where: f"{w}: {m}")


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_nan_in_q_k_v_or_grad_stays_in_its_document(ranks: Ranks, method: str, world: int) -> None:
    """cp_sdpa, one NaN in q, k, v or the upstream gradient of one token (meta row 0, head 1):
    every other document's output, dq, dk and dv equal the clean one-process reference."""
    layout = "contiguous" if world == 1 else "random"
    want = attention_reference(layout, world)
    docs = want["docs"]
    for which in ("q", "k", "v", "go"):
        results = ranks(world, attention_with_nan_case, method, layout, which)
        for got in results:
            idx = got["idx"]
            clean = docs[:, idx] != docs[0, BAD_SLOT]
            clean[1] = True  # meta row 1 is another row: its document ids are its own
            for name in ("out", "dq", "dk", "dv"):
                ref = want[name].index_select(2, idx)
                for r in range(2):
                    torch.testing.assert_close(
                        got[name][r][:, clean[r]], ref[r][:, clean[r]],
                        msg=lambda m, n=name, w=which, r=r: f"NaN in {w}: {n} row {r}: {m}",
                    )  # fmt: skip
        # the bad document itself is not silently finite
        shows = "dq" if which == "go" else "out"
        assert any(bool(got[shows].isnan().any()) for got in results), which
