"""Garbage collection in the suite's long-lived processes (pytest itself, the scenario
launches, the documentation runner).

Such a process imports PyTorch, transformers and Lightning: some 350,000 objects that are
never garbage, which every full collection walks again (0.1-0.4 s each; 14 of the quick
lane's 80 CPU seconds went to it). `settle` collects once and moves what survived out of
later collections; `tune` makes the young generation larger, so that collections come
less often. Neither changes what is collected: an object made after `settle` is
collected as before, and `gc.collect()` in a test still collects everything it made.
"""

from __future__ import annotations

import gc

# Python's default is (700, 10, 10). A test makes many small objects (tensors, autograd
# nodes, frames) that die young: with 20,000 they are mostly freed by reference counting
# before a collection would walk them.
_THRESHOLDS = (20_000, 20, 20)


def settle() -> None:
    """Collect, then leave everything still alive out of every later collection."""
    gc.collect()
    gc.freeze()


def tune() -> None:
    gc.set_threshold(*_THRESHOLDS)
