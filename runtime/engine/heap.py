"""The serving process's heap after start: frozen out of the cyclic garbage collector's reach.

Python's full (generation 2) collections walk every tracked object. In a serving process most of them were
made at start (torch, transformers, the tokenizer, the engine and its backend: a quarter of a million with
the tiny model) and live until exit, so each full collection stalls the engine loop, and the GPU waiting on
it, for ~0.1 s (measured over the null backend at batch 256: a 95-129 ms step among 0.6 ms ones,
benchmarks/host_overhead.py). `gc.freeze()` moves them to the permanent generation, which collections skip;
vLLM's engine core and SGLang do the same after their warm-up. What is frozen is never collected as cyclic
garbage, so this runs once, after start, in a process that serves until it exits (the Triton stub)."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("trtserve.heap")


def freeze_startup_heap(process: str) -> int:
    """Collect what start-up left behind, then freeze the rest; returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects made at start frozen out of the garbage collector's passes", process, frozen)
    return frozen
