"""Atomic engine-directory writes and the manifest that describes an engine."""

from __future__ import annotations

import contextlib
import json
import platform
import shutil
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from builder.sources import sha256_file
from engine_format.files import MANIFEST

VERSIONED_PACKAGES = ("trtserve", "torch", "transformers", "onnx", "onnxruntime", "numpy", "tokenizers")


@contextlib.contextmanager
def atomic_directory(output: Path) -> Iterator[Path]:
    """Yield a staging dir beside `output`; on success it replaces `output` in one rename.

    On any failure the staging dir is removed and an existing `output` is left untouched.
    """
    output = output.resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.building-", dir=output.parent))
    try:
        yield staging
        staging.chmod(0o755)  # mkdtemp makes 0700; an engine dir is read by other users (Triton)
        for path in staging.iterdir():
            path.chmod(0o644)
        retired = None
        if output.exists():
            retired = output.parent / f".{output.name}.old-{staging.name.rsplit('-', 1)[-1]}"
            output.rename(retired)
        staging.rename(output)
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def package_versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for dist in VERSIONED_PACKAGES:
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return found


def files_sha256(directory: Path, exclude: tuple[str, ...] = (MANIFEST,)) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name not in exclude}


def write_manifest(directory: Path, manifest: dict) -> None:
    manifest = {
        **manifest,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": package_versions(),
        "files_sha256": files_sha256(directory),
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
