"""Cost of entering and leaving ``ctx()`` for an HF model (attention implementation switch).

Usage: ``python benchmarks/bench_hf_scope.py [--layers 32] [--repeat 200]``

``prepare_cp_forward`` leaves an HF model's ``attn_implementation`` alone; its ``ctx()`` selects
cpshard's attention on entry and restores the model's own on exit (``set_attn_implementation``,
which walks the model's modules). This times one enter+exit with an empty inner context on a
narrow Llama of ``--layers`` layers (the walk depends on the module count, not the width).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import transformers

from cpshard.attention.hf import cp_attention_scope


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeat", type=int, default=200)
    a = p.parse_args()
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=a.layers,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    for _ in range(5):
        with cp_attention_scope(model, contextlib.nullcontext):
            pass
    times = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        with cp_attention_scope(model, contextlib.nullcontext):
            pass
        times.append(time.perf_counter() - t0)
    times.sort()
    modules = sum(1 for _ in model.modules())
    median_ms = times[len(times) // 2] * 1e3
    print(f"layers={a.layers} modules={modules} enter+exit median {median_ms:.3f} ms")


if __name__ == "__main__":
    main()
