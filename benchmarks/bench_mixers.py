"""Token mixers outside attention under CP: time per rank against one process.

For one Mamba2 mixer (``Mamba2Mixer``, SSD) and one Gated DeltaNet (``Qwen3NextGatedDeltaNet``)
of transformers' pure-torch paths, forward + backward of the module alone on ``[1, S, D]`` fp32:

* ``one process``: the module over the whole sequence;
* ``native cp=C``: :mod:`cpshard.mixers.mamba2` / :mod:`cpshard.mixers.gdn` (each rank runs
  the scan / delta rule over its own tokens; halo and incoming state exchanged), per rank;
* ``generic cp=C``: the module under a CP ctx with cpshard's generic exact path
  (:mod:`cpshard.mixers.generic`: all-gather the input, run over the whole sequence on every
  rank, keep the local rows, reduce-scatter the input gradient), per rank, on ``C`` forked gloo
  ranks (contiguous layout).

The ratio ``generic / one process`` is the generic path's cost per rank (>= 1 by construction:
every rank computes the whole sequence). Ranks share the machine's cores, so on a small machine
the per-rank times of ``C`` concurrent ranks also include CPU contention.

Usage: ``python benchmarks/bench_mixers.py [--seq 16384] [--repeat 3] [--worlds 2 4]
[--kinds mamba2 gdn] [--paths native generic]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import cpshard
from cpshard.launch import run_local_ranks
from cpshard.mixers import MixerPlan, find_token_mixers, with_token_mixers
from cpshard.mixers.gdn import is_native_gdn
from cpshard.mixers.mamba2 import is_native_mamba2

_HIDDEN = 256


def _mixer(kind: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "mamba2":
        cfg = tf.Mamba2Config(
            vocab_size=64, hidden_size=_HIDDEN, state_size=64, num_hidden_layers=1, expand=2,
            num_heads=8, head_dim=64, n_groups=1, chunk_size=256, conv_kernel=4, use_cache=False,
        )  # fmt: skip
        model: Any = tf.Mamba2ForCausalLM(cfg)
    else:
        cfg = tf.Qwen3NextConfig(
            vocab_size=64, hidden_size=_HIDDEN, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
            num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, layer_types=["linear_attention"], use_cache=False,
        )  # fmt: skip
        model = tf.Qwen3NextForCausalLM(cfg)
    (site,) = find_token_mixers(model)
    return site.module.float()


def _time(fn: Any, repeat: int) -> float:
    fn()  # warmup
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _one_process(kind: str, seq: int, repeat: int) -> float:
    torch.set_num_threads(1)
    module = _mixer(kind)
    x = torch.randn(1, seq, _HIDDEN, generator=torch.Generator().manual_seed(1))

    def step() -> None:
        xi = x.clone().requires_grad_()
        module(xi).sum().backward()

    return _time(step, repeat)


def _cp_rank(cp_mesh: Any, kind: str, seq: int, repeat: int, path: str) -> float:
    module = _mixer(kind)
    ids = torch.randint(1, 64, (1, seq), generator=torch.Generator().manual_seed(2))
    ctx, _, sharder = cpshard.make_cp_batch_and_ctx(
        cp_mesh, {"input_ids": ids}, layout="contiguous"
    )
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([module])  # so the module is found as a mixer site
    sites = find_token_mixers(holder)
    native = sites if path == "native" else ()
    gdn = tuple(s for s in native if is_native_gdn(s.module))
    assert all(s in gdn or is_native_mamba2(s.module) for s in native)
    ctx = with_token_mixers(ctx, MixerPlan(sites, native, "contiguous", gdn), cp_mesh)
    x = torch.randn(1, seq, _HIDDEN, generator=torch.Generator().manual_seed(1))
    local = sharder.shard_token_tensor(x, fill=0.0)

    def step() -> None:
        xi = local.clone().requires_grad_()
        with ctx():
            out = module(xi)
        out.sum().backward()

    return _time(step, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--kinds", nargs="+", default=["mamba2", "gdn"])
    parser.add_argument("--paths", nargs="+", default=["native", "generic"])
    args = parser.parse_args()
    print(
        f"S={args.seq} fp32, hidden {_HIDDEN}, fwd+bwd of one mixer module, median of {args.repeat}"
    )
    print("| mixer | one process (s) | path | cp | per rank (s, max over ranks) | ratio |")
    print("|---|---|---|---|---|---|")
    for kind in args.kinds:
        base = _one_process(kind, args.seq, args.repeat)
        for path in args.paths:
            for world in args.worlds:
                per_rank = run_local_ranks(
                    world, _cp_rank, kind, args.seq, args.repeat, path, timeout_s=3600
                )
                t = max(per_rank)
                print(f"| {kind} | {base:.3f} | {path} | {world} | {t:.3f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
