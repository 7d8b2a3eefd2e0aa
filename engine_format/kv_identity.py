"""An engine's identity as KV producer and consumer: what two workers must share for one's KV blocks to be valid
in the other's pool (engine_format/kv_handle.py carries it; the handshake compares it field by field).

The weights' SHA-256 (from the manifest, which serving verifies against the files at load): KV computed by
other weights is wrong even when every shape matches. The model's shape and dtypes, and an fp8 pool's static
scales (the same codes mean other values under other scales). The target is left out: a CPU and a GPU build
of the same weights write the same KV values, which is the point of moving them.
"""

from __future__ import annotations

import hashlib
import json

from engine_format.config import EngineConfig
from engine_format.files import MANIFEST, WEIGHTS_FILE
from engine_format.kv_cache import pool_dtype
from engine_format.kv_handle import KVLayout


def kv_layout(config: EngineConfig) -> KVLayout:
    spec = config.model
    return KVLayout(
        num_layers=spec.num_layers,
        block_size=config.block_size,
        kv_width=spec.kv_width,
        num_kv_heads=spec.num_kv_heads,
        dtype=pool_dtype(config.dtype, config.kv_cache_dtype),
        kv_cache_dtype=config.kv_cache_dtype,
    )


def kv_identity(config: EngineConfig) -> dict[str, str]:
    """{field: value} naming the engine whose KV this is (strings: compared and printed as they are)."""
    manifest = json.loads((config.engine_dir / MANIFEST).read_text())
    weights = (manifest.get("files_sha256") or {}).get(WEIGHTS_FILE, "unknown")
    model = json.dumps(config.model.to_dict(), sort_keys=True)
    return {
        "weights_sha256": str(weights),
        "model": hashlib.sha256(model.encode()).hexdigest()[:16],
        "model_type": config.model.model_type,
        "dtype": config.dtype,
        "kv_scales": "none" if config.kv_scales is None else json.dumps(config.kv_scales),
    }
