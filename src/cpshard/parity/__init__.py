"""Parity: cp=N must train exactly like cp=1, per model, dtype, batch kind, layout and method.

Owns the whole parity run that ``cpshard parity`` (:mod:`cpshard.cli.parity`, only its
arguments) drives: the training steps and their comparison (:mod:`.runs`), the models a run can
use (:mod:`.models`), the rows of a run (:mod:`.plan`), where the two sides run (:mod:`.runners`:
local forked ranks or the ranks ``torchrun`` launched), the driver loop (:mod:`.driver`) and the
report (:mod:`.report`: the table, JSON and a plot).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""
