"""Integrations of cpshard into training stacks people already use (optional dependencies).

* :mod:`cpshard.integrations.hf_trainer`: HF ``transformers.Trainer`` (``CPTrainerMixin``,
  ``CPTrainer``), needs ``transformers`` and ``accelerate``.
* :mod:`cpshard.integrations.trl_trainers`: TRL's ``SFTTrainer`` (padding-free packing included)
  and ``GRPOTrainer`` (``CPSFTTrainer``, ``CPGRPOTrainer``, ``CPGRPOMixin``), needs ``trl``.

Nothing here is imported by ``import cpshard``: import the submodule you use
(``pip install "cpshard[trl]"`` brings transformers, accelerate and trl).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""
