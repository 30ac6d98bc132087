"""The package version, once: ``pyproject.toml`` reads it (``[tool.setuptools.dynamic]``),
``cpshard.__version__`` and ``cpshard --version`` print it.

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
