"""Tools built on the public contract: loss-parity runs, balance metrics, the shipped text corpus
and the one local-rank launcher.

These serve the ``cpshard`` command, the tests, the benchmarks and the examples. They may import
any part of cpshard; nothing in the core (:mod:`cpshard.layouts`, :mod:`cpshard.sharding`,
:mod:`cpshard.guards`, :mod:`cpshard.attention`, :mod:`cpshard.dispatch`, :mod:`cpshard.loss`,
:mod:`cpshard._comm`) imports them.
"""
