"""Token mixers outside attention under CP: detection, refusal, and the generic exact path.

* :mod:`~cpshard.mixers.detect`: which modules of a model mix tokens and are not attention;
* :mod:`~cpshard.mixers.policy`: the verdict before any collective (exact path, warning or a
  clear error) and the ctx composition;
* :mod:`~cpshard.mixers.mamba2`: native CP for Mamba2 (SSD) mixers (halo + state passing);
* :mod:`~cpshard.mixers.gdn`: native CP for Gated DeltaNet mixers (halo + affine state summary);
* :mod:`~cpshard.mixers.segments` and :mod:`~cpshard.mixers.generic`: running a mixer over whole
  documents in global order (gather, run, keep the local rows).

Import rules: the rows of ``RULES`` in tests/unit/test_architecture.py that cover this module.
"""

from cpshard.mixers.detect import MixerSite, find_token_mixers
from cpshard.mixers.policy import (
    CPMixerWarning,
    MixerPlan,
    check_token_mixers,
    with_token_mixers,
)

__all__ = [
    "CPMixerWarning",
    "MixerPlan",
    "MixerSite",
    "check_token_mixers",
    "find_token_mixers",
    "with_token_mixers",
]
