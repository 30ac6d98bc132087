"""GPU tier: ``torchrun -m cpshard parity`` on CUDA ranks (NCCL), the table and JSON as on CPU.

Skipped without CUDA (and the NCCL case without two GPUs). Run with ``python3 -m pytest tests/gpu``.
Where ``CPSHARD_GPU_CHECK_OUT`` names a folder (``benchmarks/gpu_check.sh`` sets it to ``$OUT``),
the parity JSON is written there, so it comes back from a short GPU run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _gpu_fns import PARITY_TIMEOUT_S

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("world", [1, 2])
def test_parity_under_torchrun_on_cuda(world: int, tmp_path: Path) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    keep = os.environ.get("CPSHARD_GPU_CHECK_OUT")
    js = (Path(keep) if keep else tmp_path) / f"parity_torchrun_{world}.json"
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(world), "-m", "cpshard", "parity"]
    cmd += ["--ranks", str(world), "--models", "llama", "--steps", "2", "--seq-len", "64"]
    cmd += ["--methods", "all_gather,ring", "--layouts", "round_robin", "--timeout", "45"]
    cmd += ["--json", str(js), "--no-progress"]
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=PARITY_TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads(js.read_text())
    cp = [r for r in records if r["kind"] == "cp"]
    assert cp and all(r["passed"] for r in records)
    assert all(r["device"].startswith("cuda") for r in records)
    assert all(r["peak_mem_kind"] == "cuda_max_allocated" for r in records)
    if world > 1:
        assert all(r["backend"] == "nccl" and len(r["peak_mem_mb"]) == world for r in cp)
