"""The engine manifest: what the builder writes and every reader (runtime, calibration) loads.

`EngineConfig.manifest_fields()` and `EngineConfig.load()` are the two halves of one schema;
the builder adds provenance (source, versions, hashes, verification) around these fields.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_format.errors import EngineLoadError
from engine_format.files import GRAPH_FILE, MANIFEST, PLUGIN_GRAPH_FILE, WEIGHTS_FILE, segment_file
from engine_format.kv_cache import QUANTIZED_KV_DTYPES, check_kv_cache, pool_dtype
from engine_format.model_spec import ModelSpec
from engine_format.verify import verify_engine_files

FORMAT = "trtserve-engine"
# 2: CPU segments take tokens as [tokens, 1]. 3: the graphs take `logit_rows` and return logits
# for those rows (several per sequence when speculative drafts are verified), not one per sequence.
FORMAT_VERSION = 3
# What an engine is compiled for (the manifest's "backend" key). The runtime's executors are
# "backends" (executors.BACKENDS); a target decides which of them can run an engine.
TARGETS = ("onnxruntime-cpu", "tensorrt")
DEFAULT_MAX_STEP = 512  # longest prefill chunk a TensorRT profile accepts
MAX_LOGIT_ROWS_PER_SEQ = 8  # a TensorRT plan's logits buffer: up to 7 speculative tokens + 1 per sequence


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def verified_backends(manifest: dict) -> tuple[str, ...]:
    """The manifest's verified backends: each in verification.backends, unless its own quality gate failed."""
    backends = (manifest.get("verification") or {}).get("backends", {})
    return tuple(kind for kind, record in backends.items() if (record.get("gate") or {}).get("passed", True))


@dataclass(frozen=True)
class TensorRTLimits:
    """The shapes a TensorRT plan accepts (its optimization profiles are built from these)."""

    max_batch: int
    max_step: int  # longest prefill chunk
    max_table_blocks: int  # block-table width: blocks per sequence
    max_num_blocks: int  # pool size
    max_logit_rows: int  # rows of `logits` one call returns (logit_rows' length)

    @classmethod
    def from_build(cls, max_batch_size: int, max_seq_len: int, block_size: int,
                   max_step: int = DEFAULT_MAX_STEP) -> TensorRTLimits:  # fmt: skip
        blocks = ceil_div(max_seq_len, block_size)
        step = min(max_step, max_seq_len)
        rows = max_batch_size * min(MAX_LOGIT_ROWS_PER_SEQ, step)
        return cls(max_batch_size, step, blocks, max_batch_size * blocks, rows)


@dataclass(frozen=True)
class EngineConfig:
    engine_dir: Path
    target: str  # one of TARGETS
    dtype: str
    block_size: int
    max_batch_size: int
    max_seq_len: int
    model: ModelSpec
    graph_file: str = GRAPH_FILE
    cpu_segments: int = 0  # segment.NN.onnx files for the CPU kernel backend (float32 engines)
    quantization: str | None = None  # calibration method (fp8, int4-awq, int4-rtn) or None
    tensorrt: TensorRTLimits | None = None  # target "tensorrt" only
    # The KV pool's storage (engine_format/kv_cache.py): "auto" (model dtype), "int8" or "fp8";
    # fp8 engines carry one static (k_scale, v_scale) per layer.
    kv_cache_dtype: str = "auto"
    kv_scales: tuple[tuple[float, float], ...] | None = None
    # The backends the builder checked this engine on against HF eager (provenance: the manifest's
    # verification.backends) and, for those that quantize as they load (cpu-int8), whose quality gate passed:
    # a backend that changes the arithmetic is a default only where it was verified.
    verified_backends: tuple[str, ...] = ()

    @property
    def kv_quantized(self) -> bool:
        return self.kv_cache_dtype in QUANTIZED_KV_DTYPES

    @property
    def kv_pool_dtype(self) -> str:
        """numpy dtype name of the pool's elements (float32, float16, int8, uint8 for fp8 bits)."""
        return pool_dtype(self.dtype, self.kv_cache_dtype)

    @property
    def has_cpu_segments(self) -> bool:
        return self.cpu_segments > 0

    @property
    def max_blocks_per_seq(self) -> int:
        return ceil_div(self.max_seq_len, self.block_size)

    def with_graph(self, graph_file: str) -> EngineConfig:
        return dataclasses.replace(self, graph_file=graph_file)

    def manifest_fields(self) -> dict[str, Any]:
        """The manifest keys `load` reads back."""
        fields: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "backend": self.target,
            "dtype": self.dtype,
            "model": self.model.to_dict(),
            "limits": {
                "max_batch_size": self.max_batch_size,
                "max_seq_len": self.max_seq_len,
                "block_size": self.block_size,
            },
            "graph": {
                "file": self.graph_file,
                "weights": WEIGHTS_FILE,
                "interface": f"engine_format/INTERFACE.md (paged-KV step interface, format v{FORMAT_VERSION})",
                "cpu_segments": [segment_file(i) for i in range(self.cpu_segments)],
                "plugin_graph": PLUGIN_GRAPH_FILE,
            },
        }
        if self.quantization:
            fields["quantization"] = {"method": self.quantization}
        fields["kv_cache"] = {"dtype": self.kv_cache_dtype}
        if self.kv_scales is not None:
            fields["kv_cache"]["scales"] = [list(pair) for pair in self.kv_scales]
        if self.tensorrt:
            fields["tensorrt"] = {"limits": dataclasses.asdict(self.tensorrt)}
        return fields

    @classmethod
    def load(cls, engine_dir: str | Path, *, verify: bool = False) -> EngineConfig:
        """The engine's config from its manifest; EngineLoadError when it cannot be used.

        `verify`: also check every file against the manifest's SHA-256 digests (engine_format/verify.py;
        TRTSERVE_VERIFY=fast|full|off), as serving does (LLMEngine). Off by default for readers that
        only inspect an engine, or that damage a copy on purpose (the quality gate's corruption tests)."""
        engine_dir = Path(engine_dir)
        path = engine_dir / MANIFEST
        if not path.is_file():
            raise EngineLoadError(
                f"{engine_dir} is not an engine directory (no {MANIFEST}); "
                "build one with: build-engine --model ... --output DIR"
            )
        try:
            manifest = json.loads(path.read_text())
            if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
                raise EngineLoadError(
                    f"{path}: format {manifest.get('format')!r} v{manifest.get('format_version')} "
                    f"is not {FORMAT!r} v{FORMAT_VERSION}; rebuild the engine with build-engine "
                    "(format 3 changed the step interface: logits for the rows in `logit_rows`)"
                )
            limits = manifest["limits"]
            trt = manifest.get("tensorrt")
            kv = manifest.get("kv_cache") or {}  # absent (engines built before it): "auto"
            kv_scales = kv.get("scales")
            config = cls(
                engine_dir=engine_dir,
                target=manifest["backend"],
                dtype=manifest["dtype"],
                block_size=limits["block_size"],
                max_batch_size=limits["max_batch_size"],
                max_seq_len=limits["max_seq_len"],
                graph_file=manifest["graph"]["file"],
                model=ModelSpec.from_dict(manifest["model"]),
                cpu_segments=len(manifest["graph"].get("cpu_segments", [])),
                quantization=(manifest.get("quantization") or {}).get("method"),
                tensorrt=TensorRTLimits(**trt["limits"]) if trt else None,
                kv_cache_dtype=kv.get("dtype", "auto"),
                kv_scales=tuple((float(k), float(v)) for k, v in kv_scales) if kv_scales is not None else None,
                verified_backends=verified_backends(manifest),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise EngineLoadError(f"{path} is malformed ({type(exc).__name__}: {exc}); rebuild") from None
        if config.target not in TARGETS:
            raise EngineLoadError(f"{path}: target {config.target!r} is not one of {', '.join(TARGETS)}; rebuild")
        if problem := check_kv_cache(config.kv_cache_dtype, config.kv_scales, config.model.num_layers):
            raise EngineLoadError(f"{path}: {problem}; rebuild")
        if verify:
            verify_engine_files(engine_dir, manifest)
        if not (engine_dir / config.graph_file).is_file():
            raise EngineLoadError(f"{engine_dir}: graph file {config.graph_file} is missing; rebuild")
        return config
