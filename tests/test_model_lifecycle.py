"""The Triton model's lifecycle thread (runtime/triton_model/lifecycle.py): a drain with nothing left in flight
frees the requests' garbage, so tritonserver can unload the model at once (it waits for every response sender
of a decoupled model to be deleted, and senders caught in reference cycles are deleted only by a collection)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

from engine_format.serving import drain_state, request_drain
from runtime.engine.stats import EngineProgress
from runtime.triton_model.lifecycle import ModelLifecycle


class Sender:
    """Stands in for a pb_utils response sender left in a reference cycle (a coroutine frame, a traceback)."""

    def __init__(self) -> None:
        self.cycle = self


def test_a_drain_with_nothing_in_flight_collects_reference_cycles(tmp_path):
    loop, in_flight = asyncio.new_event_loop(), set()
    collected = threading.Event()
    sender = Sender()
    weakref.finalize(sender, collected.set)
    del sender
    gc.disable()  # only the lifecycle's own collection may free it
    lifecycle = ModelLifecycle(tmp_path, loop, in_flight, lambda: EngineProgress(0, 0, None))
    try:
        time.sleep(0.5)  # serving: the heartbeat runs, no collection
        assert not collected.is_set()
        in_flight.add("a request")
        request_drain(tmp_path, time.time() + 60)
        assert collected.wait(0.6) is False  # draining, but a request is still in flight
        assert drain_state(tmp_path) == {"in_flight": 1, "cut": 0}
        in_flight.clear()
        assert collected.wait(5)
    finally:
        gc.enable()
        lifecycle.stop()
        loop.close()
