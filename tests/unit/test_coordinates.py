"""The caller-coordinate <-> padded-stream map (cpshard.layouts.coordinates), no process group."""

from __future__ import annotations

import pytest
import torch

from cpshard.layouts.coordinates import (
    CallerCoordinates,
    positions_to_stream,
    stream_to_positions,
)
from cpshard.layouts.documents import PackSpec
from cpshard.layouts.packed import plan_packed

# Two rows of 4; row 0 holds tokens in stream slots 5, 0, 2 and a dropped pad; P = 7.
POS = torch.tensor([[5, 0, 2, -1], [1, 6, 3, -1]])


def test_positions_round_trip_and_fill() -> None:
    x = torch.arange(8.0).reshape(2, 4, 1).repeat(1, 1, 3)  # [B, S, F]
    stream = positions_to_stream(x, POS, 7, fill=-1.0)
    assert stream.shape == (7, 3)
    assert stream[:, 0].tolist() == [1.0, 4.0, 2.0, 6.0, -1.0, 0.0, 5.0]  # slot 4: no token
    back = stream_to_positions(stream, POS, fill=9.0)
    expected = x.clone()
    expected[:, 3] = 9.0  # dropped caller slots take `fill`
    torch.testing.assert_close(back, expected)


def test_positions_map_is_differentiable_and_never_aliases() -> None:
    x = torch.randn(2, 4, requires_grad=True)
    stream = positions_to_stream(x, POS, 7, fill=0.0)
    assert stream.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    (stream * torch.arange(7.0)).sum().backward()
    assert x.grad is not None
    want = torch.where(POS >= 0, POS, 0).float() * (POS >= 0)
    torch.testing.assert_close(x.grad, want)
    s = torch.randn(7, requires_grad=True)
    stream_to_positions(s, POS, fill=0.0).sum().backward()
    assert s.grad is not None and s.grad.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]


def test_packed_plan_uses_the_same_map() -> None:
    plan = plan_packed(PackSpec.from_seq_lens([[3, 2], [4]], 6), 2)
    x = torch.randn(2, 6, 2)
    pos = plan.input_token_stream_positions
    torch.testing.assert_close(
        plan.to_stream(x, 0.5), positions_to_stream(x, pos, plan.padded_len, 0.5)
    )
    stream = torch.randn(plan.padded_len)
    torch.testing.assert_close(plan.from_stream(stream, 0.0), stream_to_positions(stream, pos, 0))


def test_dense_coordinates_pick_by_length() -> None:
    c = CallerCoordinates(original_seq_len=5, padded_seq_len=8)
    t = torch.arange(10).reshape(2, 5)
    padded, dim = c.to_stream(t, 1, fill=-7)
    assert dim == 1 and padded[:, 5:].eq(-7).all() and torch.equal(padded[:, :5], t)
    same = torch.zeros(3, 8)
    assert c.to_stream(same, 1, fill=None)[0] is same  # already padded: no copy here
    with pytest.raises(ValueError, match=r"original_seq_len=5 \(with `fill`\).*explicit `fill`"):
        c.to_stream(t, 1, fill=None)
    with pytest.raises(ValueError, match=r"padded_seq_len=8.*length on dim 1 is 6"):
        c.to_stream(torch.zeros(2, 6), 1, fill=0)
    assert torch.equal(c.from_stream(padded, 1, fill=None), t)


def test_position_coordinates_need_fill_and_a_stream_shard() -> None:
    c = CallerCoordinates(None, 7, input_row_shape=(2, 4), input_token_stream_positions=POS)
    x = torch.randn(2, 4)
    stream, dim = c.to_stream(x, 1, fill=0.0)
    assert stream.shape == (1, 7) and dim == 1
    with pytest.raises(ValueError, match="requires `fill` for the padded slots"):
        c.to_stream(x, 1, fill=None)
    with pytest.raises(ValueError, match="requires `fill` for dropped slots"):
        c.check_from_stream((1, 7), 1, None, "packed")
    with pytest.raises(ValueError, match=r"needs a local \[1, L, \.\.\.\] stream shard"):
        c.check_from_stream((2, 7), 1, 0.0, "packed")
    back = c.from_stream(stream, 1, fill=0.0)
    torch.testing.assert_close(back, x.masked_fill(POS < 0, 0.0))


def test_no_coordinates_to_trim_to() -> None:
    with pytest.raises(ValueError, match="captured no caller coordinates to trim to"):
        CallerCoordinates(None, 8).from_stream(torch.zeros(1, 8), 1, None, "custom")


def test_row_shape_coordinates_flatten_by_reshape() -> None:
    """A layout that flattens ``[B, S]`` rows into one stream by a pure reshape (no input
    positions) is addressed in its pre-flatten row shape, with no ``fill`` needed."""
    c = CallerCoordinates(None, 12, input_row_shape=(2, 6))
    x = torch.arange(24.0).reshape(2, 6, 2)
    stream, dim = c.to_stream(x, 1, fill=None)
    assert dim == 1 and torch.equal(stream, x.reshape(1, 12, 2))
    torch.testing.assert_close(c.from_stream(stream, 1, fill=None), x)
    padded = CallerCoordinates(None, 16, input_row_shape=(2, 6))  # CP pads after the rows
    with pytest.raises(ValueError, match=r"leading row shape \(2, 6\)"):
        padded.to_stream(torch.zeros(2, 7), 1, fill=0)
    full = torch.cat([stream, torch.full((1, 4, 2), -1.0)], 1)
    torch.testing.assert_close(padded.from_stream(full, 1, fill=None), x)
