"""Rank functions for the guard-rail tests: ranks given different batches or verb inputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import cpshard
from cpshard.models import TinyDecoder, TinyDecoderConfig

B, S = 2, 12


def _base(packed: bool) -> dict[str, Any]:
    ids = torch.arange(1, B * S + 1).reshape(B, S) % 50 + 1
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -3:] = 0
    batch: dict[str, Any] = {
        "input_ids": ids,
        "labels": cpshard.shift_labels(ids, padding_mask=mask == 0),
        "attention_mask": mask,
    }
    if packed:
        del batch["attention_mask"]
        batch["seq_lens"] = [[5, 7], [4, 4]]
    return batch


def _diverge(batch: dict[str, Any], variant: str, kwargs: dict[str, Any]) -> None:
    """Apply one data-loader bug to this rank's batch (or arguments)."""
    ids = batch["input_ids"]
    if variant == "content":  # same shapes, one token differs
        ids = ids.clone()
        ids[1, 4] += 1
        batch["input_ids"] = ids
    elif variant == "swap":  # same multiset of tokens, two rows swapped
        batch["input_ids"] = ids.flip(0)
    elif variant == "seq_lens":
        batch["seq_lens"] = [[6, 6], [4, 4]]
    elif variant == "attention_mask":
        mask = batch["attention_mask"].clone()
        mask[1, -4] = 0
        batch["attention_mask"] = mask
    elif variant == "labels":
        batch["labels"] = cpshard.shift_labels(ids)
    elif variant == "position_ids":
        batch["position_ids"] = torch.arange(S).expand(B, S) + 1
    elif variant == "seq_len":  # a different S: gloo would abort on the size mismatch
        for k in ("input_ids", "labels", "attention_mask"):
            if k in batch:
                batch[k] = batch[k][:, :-4]
    elif variant == "batch_size":
        for k in ("input_ids", "labels", "attention_mask"):
            batch[k] = batch[k][:1]
    elif variant == "dtype":
        batch["input_ids"] = ids.int()
    elif variant == "extra_key":
        batch["advantages"] = torch.zeros(B, S)
    elif variant == "layout":
        kwargs["layout"] = "contiguous"
    elif variant == "attention":
        kwargs["attention"] = "ring"
    elif variant == "pad_id":
        kwargs["padding_token_id"] = 3
    elif variant == "invalid_here_only":  # only this rank's batch is malformed (S = 0)
        batch["input_ids"] = ids[:, :0]
    else:
        raise AssertionError(variant)


def divergent_batch(cp_mesh: DeviceMesh, variant: str, packed: bool, with_model: bool) -> str:
    """The last rank gets a different batch: every rank raises the same ValueError."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    batch = _base(packed)
    kwargs: dict[str, Any] = {"padding_token_id": 0}
    if rank == world - 1:
        _diverge(batch, variant, kwargs)
    model = TinyDecoder(TinyDecoderConfig(vocab_size=64))

    def call() -> Any:
        if with_model:
            return cpshard.prepare_cp_forward(model, cp_mesh, batch, **kwargs)
        return cpshard.make_cp_batch_and_ctx(cp_mesh, batch, **kwargs)

    with pytest.raises(ValueError, match="were given different batches") as info:
        call()
    msg = str(info.value)
    assert f"ranks {list(range(world - 1))} vs ranks [{world - 1}]" in msg or variant in (
        "seq_len",
        "batch_size",
    ), msg
    return msg


def same_batch_passes(cp_mesh: DeviceMesh, packed: bool) -> int | None:
    """Identical batches pass the check; the opt-out skips it."""
    _, _, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, _base(packed))
    assert sharder.check_consistency
    mine = _base(packed)
    if cp_mesh.get_local_rank() == cp_mesh.size() - 1:
        _diverge(mine, "content", {})
    # the opt-out reads no values (its one exchange still runs): a divergent batch is the
    # caller's responsibility then
    _, _, off = cpshard.make_cp_batch_and_ctx(cp_mesh, mine, check_consistency=False)
    assert not off.check_consistency
    return sharder.padded_seq_len


def divergent_gather(cp_mesh: DeviceMesh, variant: str) -> str:
    """gather_token_tensor given different dtypes / shapes / arguments raises on every rank."""
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    _, out, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, _base(False))
    t: Any = torch.randn(out["input_ids"].shape)
    kwargs: dict[str, Any] = {}
    if rank == world - 1:
        if variant == "dtype":
            t = t.view(torch.int32)  # same bytes: the all-gather itself would not notice
        elif variant == "shape":
            t = t[:1]
        elif variant == "not_a_tensor":
            t = t.tolist()
        elif variant == "trim":
            kwargs["trim"] = True
        else:
            raise AssertionError(variant)
    with pytest.raises(ValueError, match="gather_token_tensor was called with different") as info:
        sharder.gather_token_tensor(t, **kwargs)
    # the group is still usable afterwards: the next gather runs normally
    full = sharder.gather_token_tensor(out["labels"].float())
    assert full.shape == (B, sharder.padded_seq_len)
    return str(info.value)


def _tiny() -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder(TinyDecoderConfig(vocab_size=64))


def stale_state(cp_mesh: DeviceMesh, case: str) -> str:
    """A ctx / sharder of one batch used with another batch of the same length raises."""
    model = _tiny()
    b1, b2 = _base(True), _base(True)
    b2["seq_lens"] = [[6, 6], [4, 4]]  # same length, other documents: another map and meta
    ctx1, l1, s1 = cpshard.prepare_cp_forward(model, cp_mesh, b1)
    ctx2, l2, s2 = cpshard.prepare_cp_forward(model, cp_mesh, b2)
    with ctx2:  # the right pairing works, spelled `with ctx:` too
        good = model(l2["input_ids"], l2["position_ids"])
    with ctx2():
        assert torch.equal(good, model(l2["input_ids"], l2["position_ids"]))
    pattern = "another batch"
    if case == "old_ctx_new_batch":
        with pytest.raises(ValueError, match=pattern) as info, ctx1():
            model(l2["input_ids"], l2["position_ids"])
    elif case == "new_ctx_old_batch":
        with pytest.raises(ValueError, match=pattern) as info, ctx2:
            model(l1["input_ids"], l1["position_ids"])
    elif case == "nested":
        with pytest.raises(ValueError, match="inside another one") as info, ctx1():  # noqa: SIM117
            with ctx2():
                pass
    elif case == "outside_ctx":
        with pytest.raises(ValueError, match="outside its ctx") as info:
            model(l1["input_ids"], l1["position_ids"])
    elif case == "verb_of_other_batch":
        with pytest.raises(ValueError, match=pattern) as info:
            s2.gather_token_tensor(l1["labels"])
    elif case == "same_batch_twice":  # policy and reference model prepared on one batch
        ctx_ref, l_ref, _ = cpshard.prepare_cp_forward(_tiny(), cp_mesh, b2)
        with ctx_ref():
            mixed = model(l2["input_ids"], l2["position_ids"])
        assert torch.equal(mixed, good)
        return "ok"
    elif case == "reused_sharder":
        ctx3, l3, s3 = cpshard.make_cp_batch_and_ctx(cp_mesh, b1, cp_sharder=s2)
        # s3 is bound to b1's shard; s2 (bound to b2's) keeps answering for b2
        assert s3 is not s2
        s2.gather_token_tensor(l2["labels"])  # a collective: every rank runs it
        with pytest.raises(ValueError, match=pattern) as info:
            s3.shard_token_tensor(l2["labels"])
        with ctx1():  # ctx1 and l1 still belong together
            model(l1["input_ids"], l1["position_ids"])
    else:
        raise AssertionError(case)
    del s1
    return str(info.value)


def _llama(cp_mesh: DeviceMesh) -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def hf_calls_under_ctx(cp_mesh: DeviceMesh, case: str) -> str:
    """HF `labels` / `attention_mask` under ctx(), and the model outside ctx(), raise."""
    model = _llama(cp_mesh)
    batch = _base(False)
    ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, batch)
    if case == "labels":
        with pytest.raises(ValueError, match=r"got `labels` inside ctx\(\)") as info, ctx():
            model(**local)
    elif case == "attention_mask":
        mask = torch.ones_like(local["input_ids"])
        with pytest.raises(ValueError, match="got an `attention_mask` inside ctx") as info, ctx():
            model(input_ids=local["input_ids"], attention_mask=mask)
    elif case == "outside_ctx":
        with pytest.raises(ValueError, match="outside its ctx") as info:
            model(input_ids=local["input_ids"], position_ids=local["position_ids"])
    elif case == "no_position_ids":  # HF would number the local tokens 0..L-1: RoPE wrong
        with pytest.raises(ValueError, match="without `position_ids`") as info, ctx():
            model(input_ids=local["input_ids"])
    else:
        raise AssertionError(case)
    assert "cp_cross_entropy" in str(info.value) or case != "labels"
    with ctx():  # the documented call works
        model(**{k: v for k, v in local.items() if k != "labels"})
    return str(info.value)


def plain_model_without_position_ids(cp_mesh: DeviceMesh) -> str:
    """A plain model whose forward defaults position_ids to 0..L-1 raises under ctx()."""
    model = _tiny()
    ctx, local, _ = cpshard.prepare_cp_forward(model, cp_mesh, _base(True))
    with pytest.raises(ValueError, match="without `position_ids`") as info, ctx():
        model(local["input_ids"])
    with ctx():  # positional position_ids count as given
        model(local["input_ids"], local["position_ids"])
    return str(info.value)


def reference_model_on_policy_batch(cp_mesh: DeviceMesh) -> None:
    """A second HF model (a reference model) prepared on the policy's batch and run under its own
    ctx on the policy's local tensors: its logits equal one process's."""
    policy, ref = _llama(cp_mesh), _llama(cp_mesh)
    batch = _base(False)
    _, local, sharder = cpshard.prepare_cp_forward(policy, cp_mesh, batch)
    call = {"input_ids": local["input_ids"], "position_ids": local["position_ids"]}
    ctx_ref, _, _ = cpshard.prepare_cp_forward(ref, cp_mesh, batch)
    with torch.no_grad(), ctx_ref():
        got = sharder.gather_token_tensor(ref(**call).logits, trim=True)
    with torch.no_grad():
        want = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)


def ddp_wrapped_hf_model(cp_mesh: DeviceMesh) -> None:
    """A DDP-wrapped HF model is looked through: CP attention under ctx(), equal to one process."""
    from torch.nn.parallel import DistributedDataParallel

    model = _llama(cp_mesh)
    wrapped = DistributedDataParallel(model)  # as Accelerate / TRL wrap it
    batch = _base(False)
    ctx, local, sharder = cpshard.prepare_cp_forward(wrapped, cp_mesh, batch)
    with torch.no_grad(), ctx():
        out = wrapped(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    got = sharder.gather_token_tensor(out, trim=True)
    assert model.config._attn_implementation == "sdpa"  # its own attention again outside ctx()
    with torch.no_grad():
        want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="outside its ctx"):  # the guard sees wrapper calls
        wrapped(input_ids=local["input_ids"], position_ids=local["position_ids"])


def routing(cp_mesh: DeviceMesh) -> None:
    """Non-causal same-length SDPA is never routed; suspend() exempts a region."""
    import warnings

    import torch.nn.functional as F

    from cpshard.attention.context import cp_context_active

    ctx, local, _ = cpshard.make_cp_batch_and_ctx(cp_mesh, _base(False))
    n = local["input_ids"].shape[1]
    q, k, v = (torch.randn(B, 2, n, 4) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)  # a vision tower's local attention
    want_causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with ctx(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = F.scaled_dot_product_attention(q, k, v)
        F.scaled_dot_product_attention(q, k, v)
        routed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with cpshard.attention.suspend():
            assert not cp_context_active()
            quiet = F.scaled_dot_product_attention(q, k, v)
            local_causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert cp_context_active()
    assert torch.equal(got, want) and torch.equal(quiet, want)
    assert torch.equal(local_causal, want_causal)
    assert not torch.allclose(routed, want_causal)  # routed: global positions and padding
    assert len([w for w in caught if "ran as LOCAL attention" in str(w.message)]) == 1


def no_aliasing(cp_mesh: DeviceMesh, layout: str) -> None:
    """Verb results and the sharded batch never share memory with the caller's tensors."""
    ids = torch.arange(1, 17).reshape(1, 16)
    batch = {"input_ids": ids, "labels": cpshard.shift_labels(ids)}
    _, local, sharder = cpshard.make_cp_batch_and_ctx(cp_mesh, batch, layout=layout)
    for key in batch:
        assert local[key].untyped_storage().data_ptr() != batch[key].untyped_storage().data_ptr()
    adv = torch.randn(1, 16)
    keep = adv.clone()
    shard = sharder.shard_token_tensor(adv, fill=0.0)
    shard.sub_(shard.mean())  # normalising advantages in place, as an RL loop does
    assert torch.equal(adv, keep)
    full = sharder.gather_token_tensor(shard)
    full.mul_(0)
    assert shard.abs().sum() > 0


def bad_inputs_everywhere(cp_mesh: DeviceMesh) -> int:
    """Pad ids and lenient parsing: each bad input raises on every rank, and the group survives."""
    ids = torch.ones(2, 8, dtype=torch.long)
    model = _tiny()
    cases: list[tuple[dict[str, Any], dict[str, Any], str]] = [
        ({"input_ids": ids}, {"padding_token_id": None}, "tokenizer.eos_token_id"),
        ({"input_ids": ids}, {"padding_token_id": -1}, "non-negative token id"),
        ({"input_ids": ids}, {"padding_token_id": 64}, "outside the model's vocabulary"),
        ({"input_ids": ids[:, :0]}, {}, "S >= 1 tokens"),
        ({"input_ids": ids, "seq_lens": [[True, 7], [8]]}, {}, "not bool, str"),
        ({"input_ids": ids, "seq_lens": "8"}, {}, "seq_lens: must be per-row"),
        ({"input_ids": ids, "attention_mask": torch.ones(2, 1, 8, 8)}, {}, "0/1 keep mask"),
        ({"input_ids": ids, "seq_lens": [[8], [8]], "seq_lens_padded": [[8], [8]]}, {}, "Fix:"),
        ({"input_ids": torch.ones(2, 8, dtype=torch.long, device="meta")}, {}, "meta-device"),
    ]
    for batch, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            cpshard.prepare_cp_forward(model, cp_mesh, batch, **kwargs)
    _, _, sharder = cpshard.prepare_cp_forward(model, cp_mesh, {"input_ids": ids})
    with pytest.raises(TypeError, match="needs a torch.Tensor"):
        sharder.gather_token_tensor([1, 2])  # type: ignore[arg-type]
    return len(cases)
