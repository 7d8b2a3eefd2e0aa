"""The `llm` model's side of disaggregation: what a request's `prefill_only` or `kv_handle` asks of the engine
before it is generated, and the errors a client sees.

A `kv_handle` is read before the request reaches the engine (awaited on the model's event loop, so other
requests keep streaming); `prefill_only` marks it to end after its first token. Whatever happens, the marks and
anything staged are dropped when the request ends. A failed read is answered "kv transfer failed: ..." with
Triton's UNAVAILABLE: the gateway recognises the words and re-prefills elsewhere (runtime/gateway/disagg.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from engine_format.kv_handle import KV_TRANSFER_FAILED
from runtime import AsyncLLM
from runtime.engine.disagg import KVTransferError
from runtime.triton_model.inputs import ParsedRequest

__all__ = ["KV_TRANSFER_FAILED", "KVTransferError", "disaggregated", "transfer_failure"]


@contextlib.asynccontextmanager
async def disaggregated(engine: AsyncLLM, parsed: ParsedRequest, request_id: str) -> AsyncIterator[None]:
    """Around a request's generation: its KV read (kv_handle) or its prefill-only mark, and their cleanup."""
    disagg = engine.disagg
    engine_id = None  # the engine's id for the request, once a door call reserved one (runtime/request_ids.py)
    try:
        if parsed.kv_handle is not None:
            imp = disagg.expect(request_id, parsed.kv_handle, parsed.params.cache_salt, parsed.params.lora)
            engine_id = imp.request_id
            await disagg.pull(imp)
        elif parsed.prefill_only:
            engine_id = disagg.export(request_id)
        yield
    finally:
        if engine_id is not None:  # its own: a request under the same id started meanwhile keeps its reservation
            disagg.forget(engine_id)


def transfer_failure(exc: KVTransferError) -> str:
    return f"{KV_TRANSFER_FAILED}: {exc}"
