"""The KV handle: what a prefill worker answers, and a decode worker is given, to move one request's KV cache.

Prefill/decode disaggregation (docs/disaggregation.md): a prefill worker runs a prompt, samples the first
token, keeps the request's KV blocks pinned and answers with this handle; a decode worker given the handle
pulls those blocks into its own pool (one transfer, by descriptor lists) and continues decoding. The handle
travels as JSON through the gateway, which reads only `recompute` (set on its fallback) and never the rest:
so the format lives here, with the other contracts, stdlib only.

What a decode worker needs, and why each field is there:
- `identity`: the engine the KV came from (weights digest, model shape, dtypes, KV scales). KV computed by
  other weights, or stored in another dtype, is garbage to this worker: refused at the handshake, by name.
- `layout`: the pool's geometry. Blocks are copied byte for byte, so block size, width, layer count, the
  element type and the axis order must match exactly.
- `agent`, `agent_metadata`, `connector`, `regions`: who to read from and where: the transfer agent's name
  and metadata (loaded once per peer: the handshake), and the base address of each registered region of
  the prefill worker's pool (its data, and for int8 its scales).
- `block_ids`, `prompt_token_ids`, `first_token`: the request's blocks (its prompt's, in order), the tokens
  they hold (checked against the decode worker's own tokenization: another tokenizer or chat template is
  refused), and the token the prefill sampled (the decode worker's first step computes its KV).
- `lora`: the LoRA adapter the KV was computed under (its content digest; None: the base model). KV is a
  function of the weights that made it: a decode worker continues only a request for the same adapter,
  holding the same adapter, and refuses any other (by name, at `expect`).
- `expires_at`: wall-clock time (time.time()) the prefill worker releases the blocks unless pulled; a
  decode worker never starts a transfer that could end after it (the blocks may then hold another
  request's KV).
- `recompute`: set by the gateway when a decode worker could not pull: the worker given it recomputes
  the prompt itself, continuing after `first_token` (the client already has that token).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

HANDLE_VERSION = 1
HANDOFF = "handoff"  # the finish reason of a prefill-only request that handed its KV on (runtime/engine/disagg.py)
# A decode worker could not read a prefill worker's KV: the prefix of its error (runtime/triton_model/kv_door.py),
# which the gateway answers by re-prefilling the request elsewhere (runtime/gateway/upstream.py, disagg.py).
KV_TRANSFER_FAILED = "kv transfer failed"
LAYOUT_ORDER = "layers,kv,blocks,block_size,kv_width"  # the CPU and torch pools' axis order (executors/kv_pool.py)


class KVHandleError(ValueError):
    """A handle that cannot be used here: malformed, expired, or from an incompatible peer (the message says)."""


@dataclass(frozen=True)
class KVLayout:
    """A KV pool's geometry: what a peer's blocks must match byte for byte."""

    num_layers: int
    block_size: int
    kv_width: int  # num_kv_heads * head_dim
    num_kv_heads: int
    dtype: str  # the pool's element dtype (float32, float16, int8, uint8 for fp8 bits)
    kv_cache_dtype: str  # auto, int8, fp8 (engine_format/kv_cache.py)
    order: str = LAYOUT_ORDER


@dataclass(frozen=True)
class KVRegion:
    """One registered allocation of a pool, [layers, 2, pool_blocks, block_bytes]: block b of layer l, side s
    starts at address + ((l * 2 + s) * pool_blocks + b) * block_bytes."""

    name: str  # "data", or "scales" (int8)
    address: int
    pool_blocks: int  # the blocks axis' length (the torch pool's has a scratch block past num_blocks)
    block_bytes: int
    memory: str = "DRAM"  # NIXL's words: DRAM (host) or VRAM (GPU)
    device: int = 0


@dataclass(frozen=True)
class KVHandle:
    handle_id: str
    connector: str  # the transport that can read it ("nixl")
    agent: str
    agent_metadata: str  # the connector's, base64
    identity: dict[str, str]
    layout: KVLayout
    regions: tuple[KVRegion, ...]
    block_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    first_token: int
    expires_at: float
    lora: str | None = None
    recompute: bool = False
    version: int = field(default=HANDLE_VERSION)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> KVHandle:
        """KVHandleError naming what is wrong with `text`."""
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError("not a JSON object")
            if raw.get("version") != HANDLE_VERSION:
                raise KVHandleError(f"kv_handle: version {raw.get('version')!r} is not {HANDLE_VERSION}")
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(raw) - known)
            if unknown:
                raise TypeError(f"unknown field {unknown[0]!r}")
            values: dict[str, Any] = dict(raw)
            values["layout"] = KVLayout(**raw["layout"])
            values["regions"] = tuple(KVRegion(**r) for r in raw["regions"])
            values["block_ids"] = tuple(int(b) for b in raw["block_ids"])
            values["prompt_token_ids"] = tuple(int(t) for t in raw["prompt_token_ids"])
            handle = cls(**values)
        except KVHandleError:
            raise
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise KVHandleError(f"kv_handle: malformed ({type(exc).__name__}: {exc})") from None
        if not handle.prompt_token_ids or not handle.block_ids:
            raise KVHandleError("kv_handle: no prompt tokens or no blocks")
        return handle


def with_recompute(text: str) -> str:
    """The handle `text` marked for recomputation (the gateway's fallback); KVHandleError if malformed."""
    return replace(KVHandle.from_json(text), recompute=True).to_json()


def compatibility_problem(local_identity: dict[str, str], local_layout: KVLayout, peer: KVHandle) -> str | None:
    """Why this worker cannot use `peer`'s blocks (None: it can), naming the first field that differs."""
    for name, mine in asdict(local_layout).items():
        theirs = getattr(peer.layout, name)
        if theirs != mine:
            return f"KV layout differs: peer agent {peer.agent!r} has {name} {theirs!r}, this worker {mine!r}"
    for name in sorted(set(local_identity) | set(peer.identity)):
        mine, theirs = local_identity.get(name), peer.identity.get(name)
        if theirs != mine:
            return f"engine differs: peer agent {peer.agent!r} has {name} {theirs!r}, this worker {mine!r}"
    return None
