"""The engine directory as the runtime sees it: manifest.json plus the files it names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from builder.model_spec import ModelSpec

MANIFEST = "manifest.json"
FORMAT = "trtserve-engine"
FORMAT_VERSION = 2  # 2: CPU segments take tokens as [tokens, 1]


class EngineLoadError(Exception):
    """The engine directory is missing, incomplete or from an incompatible build."""


@dataclass(frozen=True)
class EngineConfig:
    engine_dir: Path
    backend: str
    dtype: str
    block_size: int
    max_batch_size: int
    max_seq_len: int
    graph_file: str
    model: ModelSpec
    cpu_segments: int = 0  # segment.NN.onnx files for the CPU kernel backend (float32 engines)
    quantization: str | None = None  # calibration.quantize method (fp8, int4-awq, int4-rtn) or None

    @property
    def has_cpu_segments(self) -> bool:
        return self.cpu_segments > 0

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    @classmethod
    def load(cls, engine_dir: str | Path) -> EngineConfig:
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
                    f"is not {FORMAT!r} v{FORMAT_VERSION}; rebuild the engine"
                )
            limits = manifest["limits"]
            config = cls(
                engine_dir=engine_dir,
                backend=manifest["backend"],
                dtype=manifest["dtype"],
                block_size=limits["block_size"],
                max_batch_size=limits["max_batch_size"],
                max_seq_len=limits["max_seq_len"],
                graph_file=manifest["graph"]["file"],
                model=ModelSpec.from_dict(manifest["model"]),
                cpu_segments=len(manifest["graph"].get("cpu_segments", [])),
                quantization=(manifest.get("quantization") or {}).get("method"),
            )
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise EngineLoadError(f"{path} is malformed ({type(exc).__name__}: {exc}); rebuild") from None
        if not (engine_dir / config.graph_file).is_file():
            raise EngineLoadError(f"{engine_dir}: graph file {config.graph_file} is missing; rebuild")
        return config
