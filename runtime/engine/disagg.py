"""Prefill/decode disaggregation in the engine: the worker's role, and the hooks the engine loop calls.

Roles (EngineArgs.role, `trtserve serve --role`):
- "both" (the default): a worker as before. It also serves handles marked `recompute` (the gateway's
  fallback when a decode worker could not read the KV): it computes the prompt and continues after the
  prefill's first token. No transfer agent is started, so NIXL need not be installed.
- "prefill": requests sent `prefill_only` run their prompt, sample the first token and end there with
  finish reason "handoff": their blocks stay pinned (kv_pins.py) and the final output carries the KV
  handle (engine_format/kv_handle.py) for a decode worker.
- "decode": requests that carry a handle read the prompt's KV from the prefill worker (kv_import.py) and
  go on decoding. Both transfer roles register the KV pool with a connector (executors/kv_transfer/) at start.

The engine calls three hooks, each one line in llm_engine.py: `adopt` (add_request: a request with a
handle skips the queue), `hand_off` (after a step's outputs: prefill-only requests that have their first
token end there), `held_blocks` (the pool invariant counts pinned and staged blocks). A reaper thread ends
pins whose reader is done (the connector's notifications) or whose time is up, and frees abandoned stages:
the engine loop sleeps while it has no requests, and pins must end all the same.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_format import EngineConfig, ceil_div
from engine_format.kv_handle import HANDOFF, KVHandle
from engine_format.kv_identity import kv_identity, kv_layout
from executors.kv_transfer import KVConnector, KVTransferError, create_connector, kv_memory
from runtime.engine.engine_args import ROLES
from runtime.engine.errors import InvalidRequest
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.kv_import import Import, KVImports, PullRecord
from runtime.engine.kv_pins import KVPins
from runtime.engine.outputs import TokenOutput
from runtime.engine.request import Request
from runtime.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.02

__all__ = ["HANDOFF", "Disagg", "DisaggStats", "KVTransferError"]


@dataclass(frozen=True)
class DisaggStats:
    role: str
    handoffs: int
    pinned_blocks: int
    pins_released: int
    pins_expired: int
    staged_blocks: int
    pulls: int
    pull_failures: int
    pulled_bytes: int
    recomputes: int


class Disagg:
    def __init__(self, role: str, pin_timeout_s: float, kv: KVCacheManager, scheduler: Scheduler,
                 requests: dict[str, Request], lock: Any, clock: Callable[[], float],
                 connector: KVConnector | None = None) -> None:  # fmt: skip
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)} (got {role!r})")
        self.role, self.connector, self.requests, self.lock = role, connector, requests, lock
        self.pins = KVPins(kv.pool, pin_timeout_s, clock)
        self.imports = KVImports(kv, scheduler, connector if role == "decode" else None, lock, clock, pin_timeout_s)
        self.block_size = kv.block_size
        self.handoffs = 0
        self._exports: set[str] = set()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        if connector is not None:
            self._reaper = threading.Thread(target=self._reap, name="trtserve-kv-reaper", daemon=True)
            self._reaper.start()

    @classmethod
    def create(cls, role: str, pin_timeout_s: float, config: EngineConfig, backend: Any, kv: KVCacheManager,
               scheduler: Scheduler, requests: dict[str, Request], lock: Any,
               clock: Callable[[], float]) -> Disagg:  # fmt: skip
        """The engine's: a connector over the backend's pool for the transfer roles (KVTransferError when
        NIXL is missing), none for "both"."""
        connector = None
        if role != "both":
            connector = create_connector("nixl", kv_memory(backend, kv_layout(config)), kv_identity(config))
            log.info("role %s: KV connector %s, agent %s", role, connector.kind, connector.agent_name)
        return cls(role, pin_timeout_s, kv, scheduler, requests, lock, clock, connector)

    # ---- the doors' calls, before a request reaches the engine ----------------------------------

    def export(self, request_id: str) -> None:
        """Mark a request prefill-only: it ends after its first token, handing its KV on."""
        if self.role != "prefill":
            raise InvalidRequest("prefill_only", f"this worker's role is {self.role!r}; start it with --role prefill")
        with self.lock:
            self._exports.add(request_id)

    def expect(self, request_id: str, handle_text: str, cache_salt: str | None, lora: str | None = None) -> Import:
        """Register the KV handle of a request for adapter `lora` (InvalidRequest if unusable here); then
        `await pull(...)`."""
        return self.imports.expect(request_id, handle_text, cache_salt, lora)

    async def pull(self, imp: Import) -> None:
        await self.imports.pull(imp)

    def forget(self, request_id: str) -> None:
        """The request ended (or never started): drop its marks and free anything staged for it."""
        with self.lock:
            self._exports.discard(request_id)
        self.imports.discard(request_id)

    # ---- the engine's hooks ------------------------------------------------------------------

    def adopt(self, request: Request, resume: Callable[[Request, list[int]], None]) -> bool:
        """add_request's hook, under the engine's lock: see kv_import.py."""
        return self.imports.adopt(request, resume)

    def hand_off(self, outputs: list[TokenOutput], finish: Callable[..., TokenOutput]) -> list[TokenOutput]:
        """A step's outputs, with each prefill-only request that has its first token (and did not finish on
        it) ended by `finish` as "handoff": its blocks pinned, its output carrying the handle. The text of that
        output is the token's delta alone (the output processor does not flush what the detokenizer holds back:
        that is the decode worker's to send, which replays the token into its own detokenizer)."""
        if not self._exports:
            return outputs
        result = []
        for out in outputs:
            request = self.requests.get(out.request_id)
            if out.finish_reason is not None:  # ended on its first token (stop, length) or failed: nothing to hand
                self._exports.discard(out.request_id)
            if out.finish_reason is not None or out.request_id not in self._exports or request is None:
                result.append(out)
                continue
            self._exports.discard(out.request_id)
            handle = self._pin(request)
            final = finish(request, HANDOFF, out.token_ids, out.logprobs)
            final.kv_handle = handle.to_json()
            self.handoffs += 1
            result.append(final)
        return result

    def held_blocks(self) -> list[list[int]]:
        """Block references held outside requests (pins, staged pulls): the invariant check adds them."""
        return [list(b) for b in self.pins.held()] + self.imports.held()

    # ---- observability and shutdown ----------------------------------------------------------

    def stats(self) -> DisaggStats:
        imports = self.imports
        return DisaggStats(self.role, self.handoffs, self.pins.num_blocks, self.pins.released, self.pins.expired,
                           imports.num_staged_blocks, imports.pulls, imports.failures, imports.pulled_bytes,
                           imports.recomputes)  # fmt: skip

    def take_pull_records(self) -> list[PullRecord]:
        records, self.imports.records = self.imports.records, []
        return records

    def close(self) -> None:
        """Stop the reaper and close the connector; once (later calls do nothing)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join()
        if self.connector is not None:
            self.connector.close()

    def _pin(self, request: Request) -> KVHandle:
        assert self.connector is not None, "role prefill has a connector"
        num_prompt = request.num_prompt_tokens
        blocks = request.block_ids[: ceil_div(num_prompt, self.block_size)]
        handle_id = uuid.uuid4().hex
        self.pins.pin(handle_id, blocks)
        return KVHandle(
            handle_id=handle_id,
            connector=self.connector.kind,
            agent=self.connector.agent_name,
            agent_metadata=self.connector.metadata(),
            identity=self.connector.identity,
            layout=self.connector.layout,
            regions=self.connector.memory.regions,
            block_ids=tuple(blocks),
            prompt_token_ids=tuple(request.prompt_token_ids),
            first_token=request.all_token_ids[num_prompt],
            lora=request.lora_id,
            expires_at=time.time() + self.pins.timeout_s,
        )

    def _reap(self) -> None:
        assert self.connector is not None
        while not self._stop.wait(REAP_INTERVAL_S):
            try:
                done = self.connector.take_notifications()
                with self.lock:
                    for message in done:
                        self.pins.release(message.decode(errors="replace"))
                    if self.pins.expire():
                        log.warning("KV pins expired unread (decode worker gone, or the request abandoned)")
                self.imports.expire()
            except Exception:  # the reaper must outlive one bad round
                log.exception("KV reaper round failed")
