"""KVConnector over NIXL (NVIDIA's transfer library, the `nixl` package: pip install 'trtserve[disagg]').

Each worker's agent registers its whole KV pool at start: host memory (DRAM) on CPU, moved by the UCX backend
over shared memory or TCP; device memory (VRAM) on CUDA machines, moved over NVLink or RDMA by the same code.
A handle carries the prefill agent's metadata; a decode agent loads it the first time it sees that agent (the
handshake: the peer's engine identity and layout are checked first, and a mismatch refused by name), then
each request is one READ of a descriptor list, with the handle id as the notification the prefill agent
receives when it completes.

NIXL's agent is not thread-safe in the mode without a listener thread, and the engine calls it from two
threads (the serving loop's pulls, the reaper's notifications): every call holds one lock.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine_format.kv_handle import KVHandle, KVLayout, compatibility_problem
from executors.kv_transfer.connector import KVTransferError, PeerMismatch, Transfer, TransferState
from executors.kv_transfer.memory import KVMemory, block_descriptors

log = logging.getLogger(__name__)

BACKEND = "UCX"
# The meta package `nixl` picks nixl_cu12 / nixl_cu13 by torch's CUDA version; either alone works too
# (trtserve[disagg] installs nixl-cu12: the meta package would pull both, 140 MB).
MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
INSTALL_HINT = "prefill/decode disaggregation needs NIXL: pip install 'trtserve[disagg]' (the nixl-cu12 wheel)"


def nixl_api() -> Any:
    """NIXL's Python API module; KVTransferError saying how to install it when absent."""
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise KVTransferError(INSTALL_HINT)


class NixlConnector:
    kind = "nixl"

    def __init__(self, memory: KVMemory, identity: dict[str, str], agent_name: str | None = None) -> None:
        api = nixl_api()
        self.memory, self.identity = memory, identity
        self.agent_name = agent_name or f"trtserve-{uuid.uuid4().hex[:12]}"
        self._lock = threading.Lock()
        self._agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(backends=[BACKEND]))
        if BACKEND not in self._agent.backends:
            raise KVTransferError(f"NIXL has no {BACKEND} backend here (plugins: {self._agent.get_plugin_list()})")
        self._registered = []
        for region in memory.regions:
            rows = np.array([[region.address, memory.region_bytes(region), region.device]], dtype=np.uint64)
            self._registered.append(self._agent.register_memory(rows, region.memory))
        self._metadata = base64.b64encode(self._agent.get_agent_metadata()).decode()
        self._peers: set[str] = set()
        log.info("NIXL agent %s: %d KV regions registered (%.1f MiB)", self.agent_name, len(memory.regions),
                 sum(memory.region_bytes(r) for r in memory.regions) / 2**20)  # fmt: skip

    @property
    def layout(self) -> KVLayout:
        return self.memory.layout

    def metadata(self) -> str:
        return self._metadata

    def add_peer(self, handle: KVHandle) -> None:
        if handle.agent in self._peers:
            return
        if handle.connector != self.kind:
            raise PeerMismatch(f"peer agent {handle.agent!r} speaks {handle.connector!r}, this worker {self.kind!r}")
        problem = compatibility_problem(self.identity, self.layout, handle)
        if problem is None and [r.name for r in handle.regions] != [r.name for r in self.memory.regions]:
            problem = f"KV regions differ: peer has {[r.name for r in handle.regions]}"
        if problem is not None:
            raise PeerMismatch(f"handshake refused: {problem}")
        try:
            with self._lock:
                name = self._agent.add_remote_agent(base64.b64decode(handle.agent_metadata))
        except Exception as exc:
            raise KVTransferError(f"handshake with peer agent {handle.agent!r} failed: {exc}") from None
        loaded = name.decode() if isinstance(name, bytes) else str(name)
        if loaded != handle.agent:
            raise PeerMismatch(
                f"handshake refused: the metadata is agent {loaded!r}'s, the handle names {handle.agent!r}"
            )
        self._peers.add(handle.agent)

    def start_read(self, handle: KVHandle, remote_blocks: Sequence[int], local_blocks: Sequence[int],
                   notify: bytes) -> Transfer:  # fmt: skip
        if len(remote_blocks) != len(local_blocks):
            raise KVTransferError(f"{len(remote_blocks)} remote blocks for {len(local_blocks)} local ones")
        local = self.memory.descriptors(local_blocks)
        remote = block_descriptors(handle.regions, handle.layout.num_layers, remote_blocks)
        mem = self.memory.regions[0].memory
        try:
            with self._lock:
                request = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, mem),
                                                      self._agent.get_xfer_descs(remote, handle.regions[0].memory),
                                                      handle.agent, notify)  # fmt: skip
                state = self._agent.transfer(request)
        except Exception as exc:
            raise KVTransferError(f"reading from peer agent {handle.agent!r} failed to start: {exc}") from None
        transfer = Transfer(handle.agent, int(local[:, 1].sum()), len(local), request)
        if state == "ERR":
            self.release(transfer)
            raise KVTransferError(f"reading from peer agent {handle.agent!r} failed at once")
        return transfer

    def poll(self, transfer: Transfer) -> TransferState:
        with self._lock:
            state = self._agent.check_xfer_state(transfer.native)
        return {"DONE": TransferState.DONE, "PROC": TransferState.RUNNING}.get(state, TransferState.FAILED)

    def release(self, transfer: Transfer) -> bool:
        if transfer.native is None:
            return True
        try:
            with self._lock:
                self._agent.release_xfer_handle(transfer.native)
        except Exception as exc:  # still active and not cancellable: the caller keeps its blocks held
            log.warning("NIXL could not release a transfer from %s yet: %s", transfer.peer, exc)
            return False
        transfer.native = None
        return True

    def notify(self, peer: str, message: bytes) -> None:
        try:
            with self._lock:
                self._agent.send_notif(peer, message)
        except Exception as exc:  # the peer may be gone: its pins die with it, or time out
            log.info("notification to %s not sent: %s", peer, exc)

    def dismiss(self, handle: KVHandle) -> None:
        """The metadata is loaded for this message alone when the peer is not ours (a refused one): NIXL cannot
        message an agent it does not know. Reading from it stays refused."""
        message = handle.handle_id.encode()
        if handle.agent in self._peers:
            self.notify(handle.agent, message)
            return
        try:
            with self._lock:
                self._agent.add_remote_agent(base64.b64decode(handle.agent_metadata))
                try:
                    self._agent.send_notif(handle.agent, message)
                finally:
                    self._agent.remove_remote_agent(handle.agent)
        except Exception as exc:
            log.info("could not tell %s its blocks will not be read: %s", handle.agent, exc)

    def take_notifications(self) -> list[bytes]:
        with self._lock:
            notes = self._agent.get_new_notifs()
        return [bytes(m) for messages in notes.values() for m in messages]

    def forget_peer(self, peer: str) -> None:
        if peer in self._peers:
            self._peers.discard(peer)
            try:
                with self._lock:
                    self._agent.remove_remote_agent(peer)
            except Exception as exc:
                log.info("forgetting peer %s: %s", peer, exc)

    def close(self) -> None:
        with self._lock:
            for peer in list(self._peers):
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(peer)
            self._peers.clear()
            for registered in self._registered:
                self._agent.deregister_memory(registered)
            self._registered.clear()
