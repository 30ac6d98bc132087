"""Run a function on local CPU ranks joined by gloo: examples, demos and quick checks.

``run_local_ranks(world, fn, *args)`` forks ``world`` processes (one thread each), joins them in a
gloo process group, calls ``fn(mesh, *args)`` on every rank with a 1-D mesh of all of them and
returns the per-rank results. Build other meshes (e.g. a 2-D ``dp x cp`` mesh) inside ``fn`` with
``torch.distributed.device_mesh.init_device_mesh``. Under ``torchrun`` use the usual
``init_process_group`` instead.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from cpshard.tools.launch import run_local_ranks

__all__ = ["run_local_ranks"]
