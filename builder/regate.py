"""Re-gate a quantized engine: the builder's half of `trtserve calibrate`.

Reloads the checkpoint the manifest records and exports the unquantized reference engine
(builder work); the calibration job (calibration/job.py) rebuilds the held-out text, runs the
gate and rewrites the engine's report.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from builder.build import export_reference
from builder.sources import load_checkpoint, resolve_model
from calibration.gate import GateReport
from calibration.job import quantization_record, regate
from engine_format import EngineConfig
from engine_format.files import MANIFEST


def regate_engine(engine_dir: Path, gate_config: Path | None = None) -> GateReport:
    candidate = EngineConfig.load(engine_dir)
    quantization_record(engine_dir)  # fail before loading a checkpoint
    source = json.loads((engine_dir / MANIFEST).read_text())["source"]["model"]
    model, tokenizer = load_checkpoint(resolve_model(source))
    with tempfile.TemporaryDirectory() as scratch:
        reference = export_reference(model, candidate.model, candidate.block_size, candidate.max_seq_len, Path(scratch))
        return regate(candidate, reference, tokenizer, gate_config)
