"""The flash varlen kernels of ``benchmarks/_varlen_kernels.py``, importable by the tests.

They have no engine caller, so they live beside the benchmark that measures them; ``benchmarks/``
is not a package, so this puts it on ``sys.path`` once.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from _varlen_kernels import (  # noqa: E402
    flash_varlen_backward,
    flash_varlen_forward,
    varlen_attention,
    varlen_attention_backward,
    varlen_max_q_bound,
    varlen_visible_keys,
)

__all__ = [
    "flash_varlen_backward",
    "flash_varlen_forward",
    "varlen_attention",
    "varlen_attention_backward",
    "varlen_max_q_bound",
    "varlen_visible_keys",
]
