"""The startup heap, kept out of the garbage collector's way while serving.

A level actor or the coordinator's replica holds hundreds of thousands of long-lived objects once it has started
(torch, transformers and vLLM modules, the model, the engine). Python's cyclic collector walks them again on
every full collection, and a generation-1 collection that finds them recently promoted walks many of them too:
a pause of tens of milliseconds that lands on whichever round is running, where a GPU step lasts a few. Frozen
after the start, they sit in the collector's permanent generation and later collections walk only what serving
allocates since.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect what the start left behind, then freeze everything alive now; returns how many objects are
    frozen. Call once a long-lived process has finished starting (a level actor once its model is loaded, the
    coordinator's replica once it built the cascade); objects made later are collected as usual."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
