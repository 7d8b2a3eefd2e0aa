"""Moving KV blocks between workers' pools (prefill/decode disaggregation): the pool's memory as regions
(memory.py), the connector interface (connector.py) and its NIXL implementation (nixl_connector.py).

Below the engine: it knows pools and blocks, not requests; runtime/engine/disagg.py decides what moves."""

from executors.kv_transfer.connector import KVConnector, KVTransferError, PeerMismatch, Transfer, TransferState
from executors.kv_transfer.memory import KVMemory, block_descriptors, kv_memory

CONNECTORS = ("nixl",)


def create_connector(kind: str, memory: KVMemory, identity: dict[str, str]) -> KVConnector:
    """The connector named `kind` over `memory`; KVTransferError when it cannot start (NIXL not installed)."""
    if kind == "nixl":
        from executors.kv_transfer.nixl_connector import NixlConnector

        return NixlConnector(memory, identity)
    raise KVTransferError(f"unknown KV connector {kind!r} (known: {', '.join(CONNECTORS)})")


__all__ = [
    "CONNECTORS",
    "KVConnector",
    "KVMemory",
    "KVTransferError",
    "PeerMismatch",
    "Transfer",
    "TransferState",
    "block_descriptors",
    "create_connector",
    "kv_memory",
]
