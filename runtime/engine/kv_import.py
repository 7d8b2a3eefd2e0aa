"""Decode side of disaggregation: a request that arrives with a prefill worker's KV handle.

Its life, in the order the door drives it (runtime/triton_model/ for Triton; any caller of the Python API):
1. `expect`: the handle is registered under the request id, before the request reaches the engine. Refused
   if it was computed under another LoRA adapter than the request's, as this worker holds it (or the base).
2. `pull` (a coroutine on the caller's event loop, so the engine keeps stepping meanwhile): blocks are
   staged for the prompt (prefix-cache hits first: only what this worker lacks is read), the peer's agent is
   loaded (the handshake refuses another engine or layout), one read is started for the missing blocks and
   polled until done. Any failure, cancellation included, cancels the read and frees the staged blocks.
3. `adopt` (the engine's add_request hook, under its lock): the request takes the staged blocks and the
   prompt counts as computed; the prefill's first token is appended (sampling state, detokenizer: the
   client has its text already) and the request joins the running batch as a decode. Without a pull (a
   `recompute` handle, the gateway's fallback) or without a free sequence slot, it is queued instead and
   computes what the prefix cache lacks (pulled full blocks are indexed there first).

Blocks staged for a request that never reaches `adopt` are freed by `discard` (the door calls it when the
request ends) and, as a backstop, by `expire`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine_format import ceil_div
from engine_format.kv_handle import KVHandle, KVHandleError
from executors.kv_transfer import KVConnector, KVTransferError, PeerMismatch, Transfer, TransferState
from runtime.engine.errors import InvalidRequest, Overloaded
from runtime.engine.kv_cache_manager import KVCacheManager, block_hash, salt_root
from runtime.engine.request import Request
from runtime.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

SAFETY_S = 1.0  # a read must end this long before the handle expires (the peer then unpins)
POLL_S = (0.0005, 0.005)  # first and longest wait between polls of a running read
ROOM_POLL_S = 0.005


@dataclass
class Import:
    request_id: str
    handle: KVHandle
    cache_salt: str | None
    lora_id: str | None  # the request's adapter's digest here (the handle's: expect checks)
    deadline: float  # the clock's: staged blocks never adopted are freed then
    block_ids: list[int] = field(default_factory=list)  # staged: the prompt's blocks, hits first
    num_hits: int = 0
    transfer: Transfer | None = None
    pulled: bool = False
    handshaken: bool = False


@dataclass
class PullRecord:
    nbytes: int
    seconds: float


class KVImports:
    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, connector: KVConnector | None, pool_lock: Any,
                 clock: Callable[[], float], timeout_s: float) -> None:  # fmt: skip
        """`pool_lock`: the engine's, under which it changes the KV pool (a pull stages blocks off its thread)."""
        self.kv, self.scheduler, self.connector = kv, scheduler, connector
        self.lock, self.clock, self.timeout_s = pool_lock, clock, timeout_s
        self._imports: dict[str, Import] = {}
        self._quarantine: list[tuple[Transfer, list[int]]] = []  # reads that could not be cancelled yet
        self.records: list[PullRecord] = []  # finished reads, drained by metrics
        self.pulls = self.failures = self.recomputes = self.pulled_bytes = 0

    def expect(self, request_id: str, handle_text: str, cache_salt: str | None, lora: str | None = None) -> Import:
        """Register the handle of a request for adapter `lora` (None: the base model); InvalidRequest if it
        cannot be used here."""
        try:
            handle = KVHandle.from_json(handle_text)
        except KVHandleError as exc:
            raise InvalidRequest("kv_handle", str(exc).removeprefix("kv_handle: ")) from None
        if not handle.recompute and self.connector is None:
            raise InvalidRequest("kv_handle", "this worker reads no KV (a worker started with --role decode does); "
                                 "it recomputes only handles marked recompute")  # fmt: skip
        with self.lock:
            if request_id in self._imports:
                raise InvalidRequest("request_id", f"{request_id!r} is already in use")
            lora_id = self._lora_id(lora)
            if handle.lora != lora_id:
                raise InvalidRequest("kv_handle", _lora_mismatch(handle.lora, lora))
            imp = Import(request_id, handle, cache_salt, lora_id, self.clock() + self.timeout_s)
            self._imports[request_id] = imp
        return imp

    async def pull(self, imp: Import) -> None:
        """Stage blocks and read the missing ones (see the module's docstring); KVTransferError or Overloaded,
        with everything staged freed, when that cannot be done before the handle expires."""
        if imp.handle.recompute:
            return
        assert self.connector is not None, "expect() refuses handles to read without a connector"
        handle, connector = imp.handle, self.connector
        last_start = handle.expires_at - SAFETY_S
        try:
            if time.time() > last_start:
                raise KVTransferError(f"the KV handle expired {time.time() - handle.expires_at:+.1f} s ago (pins "
                                      "time out: raise --kv-pin-timeout on the prefill workers)")  # fmt: skip
            try:
                connector.add_peer(handle)  # the handshake: PeerMismatch names what differs
            except PeerMismatch:
                connector.dismiss(handle)  # the peer may unpin now
                raise
            imp.handshaken = True
            while not self._stage(imp):
                if time.time() > last_start:
                    raise Overloaded("overloaded: no KV blocks free on this decode worker before the handle expired")
                await asyncio.sleep(ROOM_POLL_S)
            start, missing = time.perf_counter(), slice(imp.num_hits, len(imp.block_ids))
            if imp.num_hits < len(imp.block_ids):
                remote, local = handle.block_ids[missing], imp.block_ids[missing]
                imp.transfer = connector.start_read(handle, remote, local, handle.handle_id.encode())
                await self._wait(imp.transfer, handle, last_start)
                self.records.append(PullRecord(imp.transfer.nbytes, time.perf_counter() - start))
                self.pulled_bytes += imp.transfer.nbytes
                connector.release(imp.transfer)
                imp.transfer = None
            else:  # every block was cached here: nothing to read, the peer may unpin now
                connector.notify(handle.agent, handle.handle_id.encode())
            imp.pulled = True
            self.pulls += 1
        except BaseException as exc:
            self.failures += 1
            if isinstance(exc, KVTransferError) and imp.transfer is not None:
                connector.forget_peer(handle.agent)  # a failed read: the peer is likely gone
            self.discard(imp.request_id)
            raise

    async def _wait(self, transfer: Transfer, handle: KVHandle, last_start: float) -> None:
        assert self.connector is not None
        delay = POLL_S[0]
        while (state := self.connector.poll(transfer)) is TransferState.RUNNING:
            if time.time() > handle.expires_at - SAFETY_S / 2:
                raise KVTransferError(f"reading the KV from peer agent {handle.agent!r} did not finish before "
                                      "its handle expired")  # fmt: skip
            await asyncio.sleep(delay)
            delay = min(2 * delay, POLL_S[1])
        if state is TransferState.FAILED:
            raise KVTransferError(f"reading the KV from peer agent {handle.agent!r} failed (is it still running?)")

    def _stage(self, imp: Import) -> bool:
        """Blocks for the prompt: hits on this worker's prefix cache first, then new ones; False (nothing
        taken) while the pool cannot spare them beyond a block per running request (their next tokens)."""
        prompt, bs, pool = imp.handle.prompt_token_ids, self.kv.block_size, self.kv.pool
        if len(imp.handle.block_ids) != ceil_div(len(prompt), bs):
            raise KVTransferError(f"the handle has {len(imp.handle.block_ids)} blocks for {len(prompt)} tokens")
        with self.lock:
            hits = []
            if self.kv.enable_prefix_caching:
                parent = salt_root(imp.cache_salt, imp.lora_id)
                for i in range(len(prompt) // bs):
                    parent = block_hash(parent, prompt[i * bs : (i + 1) * bs])
                    block = pool.lookup(parent)
                    if block is None:
                        break
                    hits.append(block)
            need = ceil_div(len(prompt), bs) - len(hits)
            reusable = sum(b.ref_cnt == 0 for b in hits)
            if need > pool.num_free_blocks - reusable - len(self.scheduler.running):
                return False
            pool.touch(hits)
            imp.block_ids = [b.block_id for b in hits] + [b.block_id for b in pool.get_new_blocks(need)]
            imp.num_hits = len(hits)
        return True

    def adopt(self, request: Request, resume: Callable[[Request, list[int]], None]) -> bool:
        """The engine's add_request hook (under its lock): True if the request had a handle (it is then running
        or queued here), False to queue it as usual. InvalidRequest (blocks freed) if its prompt differs."""
        imp = self._imports.pop(request.request_id, None)
        if imp is None:
            return False
        handle = imp.handle
        if tuple(request.prompt_token_ids) != handle.prompt_token_ids:
            self._free(imp)
            raise InvalidRequest("kv_handle", f"the handle's prompt ({handle.num_prompt_tokens} tokens) differs from "
                                 "this request's: another prompt, tokenizer or chat template")  # fmt: skip
        if request.lora_id != imp.lora_id:  # another adapter than expect() was told, or it changed since
            self._free(imp)
            raise InvalidRequest("kv_handle", _lora_mismatch(handle.lora, request.params.lora))
        resume(request, [handle.first_token])  # generated (and its text sent) by the prefill worker
        now = self.clock()
        request.timing.first_scheduled = now
        request.timing.on_token(now)
        if imp.pulled and imp.block_ids:
            blocks, imp.block_ids = imp.block_ids, []
            self.scheduler.add_computed(request, blocks, imp.num_hits)
            return True
        self.recomputes += 1
        self.scheduler.add(request, bounded=not imp.pulled)
        return True

    def _lora_id(self, lora: str | None) -> str | None:
        """The digest of the adapter `lora` as this worker serves it; InvalidRequest if it serves none so named."""
        if lora is None:
            return None
        if self.scheduler.loras is None:
            raise InvalidRequest("lora", f"adapter {lora!r}: this server serves no LoRA adapters")
        return self.scheduler.loras.digest(lora)

    def get(self, request_id: str) -> Import | None:
        """The request's registered handle, until adopted, discarded or expired."""
        with self.lock:
            return self._imports.get(request_id)

    def discard(self, request_id: str) -> None:
        """Forget a request's handle and free what it staged (a no-op once adopted); thread-safe."""
        with self.lock:
            imp = self._imports.pop(request_id, None)
            if imp is not None:
                self._free(imp)

    def expire(self) -> None:
        """Free staged blocks never adopted past their deadline, and reads that can be cancelled now."""
        with self.lock:
            now = self.clock()
            for request_id in [r for r, imp in self._imports.items() if imp.deadline <= now and imp.transfer is None]:
                self._free(self._imports.pop(request_id))
            still = []
            for transfer, blocks in self._quarantine:
                if self.connector is not None and self.connector.release(transfer):
                    self._free_blocks(blocks)
                else:
                    still.append((transfer, blocks))
            self._quarantine = still

    def held(self) -> list[list[int]]:
        return [imp.block_ids for imp in self._imports.values()] + [b for _, b in self._quarantine]

    @property
    def num_staged_blocks(self) -> int:
        return sum(len(b) for b in self.held())

    def _free(self, imp: Import) -> None:
        """Release the import's read (cancelled if running) and staged blocks; caller holds the lock."""
        blocks, imp.block_ids = imp.block_ids, []
        if imp.transfer is not None and self.connector is not None:
            if not self.connector.release(imp.transfer):  # still writing into the blocks: keep them
                self._quarantine.append((imp.transfer, blocks))
                return
            imp.transfer = None
        if imp.handshaken and not imp.pulled and self.connector is not None:
            self.connector.notify(imp.handle.agent, imp.handle.handle_id.encode())  # will not read: unpin now
        self._free_blocks(blocks)

    def _free_blocks(self, blocks: list[int]) -> None:
        self.kv.pool.free_blocks(self.kv.pool.blocks[b] for b in reversed(blocks))


def _lora_mismatch(computed_under: str | None, lora: str | None) -> str:
    """Why KV computed under adapter digest `computed_under` cannot continue a request for adapter `lora`."""
    theirs = "the base model" if computed_under is None else f"an adapter of digest {computed_under[:12]}"
    mine = "the base model" if lora is None else f"adapter {lora!r} as this worker holds it"
    return f"the KV was computed under {theirs}, this request asks for {mine} (both workers must serve its files)"
