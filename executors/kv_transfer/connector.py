"""The KV connector interface: how a decode worker reads a prefill worker's blocks.

One implementation today (NIXL: nixl_connector.py); the engine sees only this interface, so other transports
(LMCache, Mooncake, a shared-memory copy) plug in beside it. The model is one-sided reads: the prefill worker
registers its pool at start and hands out handles; the decode worker loads the peer's metadata once (the
handshake, which refuses a peer whose engine or layout differs), then reads each request's blocks in one
transfer, and tells the peer when it is done so the blocks are unpinned.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine_format.kv_handle import KVHandle, KVLayout
from executors.kv_transfer.memory import KVMemory


class KVTransferError(RuntimeError):
    """A transfer could not be set up or failed; the message says which peer and why."""


class PeerMismatch(KVTransferError):
    """The handshake refused a peer: its engine, dtype, block size or layout differs from this worker's."""


class TransferState(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Transfer:
    """One request's read in flight."""

    peer: str
    nbytes: int
    descriptors: int
    native: Any = field(default=None, repr=False)  # the connector's own handle


class KVConnector(Protocol):
    kind: str  # the name handles carry ("nixl")
    agent_name: str
    memory: KVMemory
    identity: dict[str, str]

    @property
    def layout(self) -> KVLayout: ...

    def metadata(self) -> str:
        """This agent's metadata for peers (base64): it goes into every handle."""
        ...

    def add_peer(self, handle: KVHandle) -> None:
        """The handshake with the handle's agent (once per agent): PeerMismatch when it cannot be read from."""
        ...

    def start_read(self, handle: KVHandle, remote_blocks: Sequence[int], local_blocks: Sequence[int],
                   notify: bytes) -> Transfer:  # fmt: skip
        """Start reading remote_blocks[i] into local_blocks[i] (every layer, K and V); the peer gets `notify`
        once the read is done."""
        ...

    def poll(self, transfer: Transfer) -> TransferState: ...

    def release(self, transfer: Transfer) -> bool:
        """Free the transfer (cancelling it if it still runs); False if it could not be cancelled (its memory
        may still be written: keep it held and try again later)."""
        ...

    def notify(self, peer: str, message: bytes) -> None:
        """Best effort: a message to a peer (a read that will not happen, so it can unpin now)."""
        ...

    def dismiss(self, handle: KVHandle) -> None:
        """Best effort: tell a handle's peer, even one the handshake refused, that its blocks will not be read."""
        ...

    def take_notifications(self) -> list[bytes]:
        """Messages peers sent this agent since the last call (finished reads: handle ids to unpin)."""
        ...

    def forget_peer(self, peer: str) -> None:
        """Drop a peer whose transfers failed (a restarted peer has a new name, and a new handshake)."""
        ...

    def close(self) -> None: ...
