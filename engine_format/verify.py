"""Check an engine's files against the SHA-256 digests its manifest records, before it is served.

`build-engine` records `files_sha256` (every file but the manifest) as the last step of a build.
Checked at serving load (`EngineConfig.load(..., verify=True)`, which LLMEngine, and so LLM,
AsyncLLM, `trtserve generate` and the Triton model, calls), a damaged or altered engine (a truncated
copy, a bad disk, a hand-edited graph, a plan or weights from another build) is refused with the file
named, instead of being served and failing later as if the model were wrong.

What is checked:
- every file `files_sha256` lists must exist and hash to its digest, except the gate reports
  (files.REWRITABLE_FILES: `trtserve calibrate` rewrites them in place; the runtime never reads them);
- files it does not list are ignored, except graph-like ones (files.GRAPH_SUFFIXES: `.onnx`, `.data`,
  `.plan`): graphs are loaded by the names the manifest gives and an ONNX graph pulls external data
  from any file beside it, so an unlisted one means the directory is not what was built (a graph
  copied in, the manifest's `graph.file` repointed), and it is refused;
- a malformed `files_sha256` (absent, not a mapping, a name that is not a plain file name, a digest
  that is not 64 hex digits) is refused.
The manifest's own bytes are not covered (it holds the digests); what it says is checked by `load`.

Modes (the `mode` argument, else the TRTSERVE_VERIFY environment variable):
- `fast` (default): a file whose (size, mtime_ns, inode) matches the digest cache (digests.py) is
  not read again, so a restart costs a stat per file. It does not catch a file rewritten with the
  same size and its mtime restored (see digests.py); use `full` after any doubt.
- `full`: every listed file is hashed (the cache is refreshed for the next fast start).
- `off`: nothing is checked, logged as a warning; for emergencies (an engine known good on a disk too
  slow to hash), not for routine use.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from engine_format.digests import DigestCache, FileStamp, default_cache_dir, is_sha256, sha256_file
from engine_format.errors import EngineIntegrityError
from engine_format.files import GRAPH_SUFFIXES, MANIFEST, REWRITABLE_FILES

log = logging.getLogger(__name__)

VERIFY_ENV = "TRTSERVE_VERIFY"
MODES = ("fast", "full", "off")


@dataclass(frozen=True)
class Verification:
    """What one check did: how many listed files it checked, and how many of them it had to read."""

    mode: str
    checked: int  # listed files compared with their digest
    hashed: int  # of those, read and hashed now (the rest came from the cache)
    hashed_bytes: int
    seconds: float


def mode_from_env() -> str:
    """TRTSERVE_VERIFY, default `fast`; an unknown value is refused rather than guessed at."""
    mode = os.environ.get(VERIFY_ENV, "").strip().lower() or "fast"
    if mode not in MODES:
        raise EngineIntegrityError(f"{VERIFY_ENV}={os.environ[VERIFY_ENV]!r} is not one of {', '.join(MODES)}")
    return mode


def listed_digests(engine_dir: Path, manifest: Mapping[str, Any]) -> dict[str, str]:
    """The manifest's files_sha256 as {file name: lowercase hex digest}; EngineIntegrityError when malformed."""
    listed = manifest.get("files_sha256")
    where, hint = f"{engine_dir / MANIFEST}: files_sha256", _rebuild(engine_dir, manifest)
    if not isinstance(listed, Mapping):
        found = "missing" if listed is None else f"a {type(listed).__name__}, not a mapping"
        raise EngineIntegrityError(f"{where} is {found}, so the engine's files cannot be verified; {hint}")
    digests = {}
    for name, digest in listed.items():
        if not _plain_file_name(name):
            raise EngineIntegrityError(f"{where} lists {name!r}, not a file of the engine directory; {hint}")
        if not (isinstance(digest, str) and is_sha256(digest.lower())):
            raise EngineIntegrityError(f"{where}[{name!r}] is {digest!r}, not a SHA-256 hex digest; {hint}")
        digests[name] = digest.lower()
    return digests


def _plain_file_name(name: object) -> bool:
    """A name directly inside the engine directory (the builder lists only those), never the manifest itself."""
    if not isinstance(name, str) or name in ("", ".", "..", MANIFEST) or "\\" in name or "\0" in name:
        return False
    return PurePosixPath(name).name == name


def verify_engine_files(
    engine_dir: Path,
    manifest: Mapping[str, Any],
    *,
    mode: str | None = None,
    cache_dir: Path | None = None,
    hash_file: Callable[[Path], str] = sha256_file,
) -> Verification:
    """Refuse (EngineIntegrityError, every problem listed) unless the engine's files match `manifest`.

    `cache_dir`: where the digest cache lives (default digests.default_cache_dir()). `hash_file` is
    injectable so tests can count the files actually read."""
    start = time.monotonic()
    mode = mode or mode_from_env()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
    if mode == "off":
        log.warning("%s=off: the files of %s are NOT checked against its manifest's SHA-256 digests",
                    VERIFY_ENV, engine_dir)  # fmt: skip
        return Verification(mode, 0, 0, 0, 0.0)
    expected = listed_digests(engine_dir, manifest)
    problems = [f"{p.name}: not listed in files_sha256 (a graph, weights or plan the build did not write)"
                for p in sorted(engine_dir.iterdir())
                if p.name.endswith(GRAPH_SUFFIXES) and p.name not in expected]  # fmt: skip
    cache = DigestCache.open(engine_dir, cache_dir if cache_dir is not None else default_cache_dir())
    checked = hashed = hashed_bytes = 0
    for name, want in sorted(expected.items()):
        if name in REWRITABLE_FILES:
            continue
        path = engine_dir / name
        checked += 1
        try:
            stamp = FileStamp.of(path)
            found = None if mode == "full" else cache.lookup(name, stamp)
            if found is None:
                found = hash_file(path)
                cache.record(name, stamp, found)
                hashed, hashed_bytes = hashed + 1, hashed_bytes + stamp.size
        except FileNotFoundError:
            problems.append(f"{name}: listed in files_sha256 (sha256 {want}) but missing from the directory")
            continue
        except OSError as exc:
            problems.append(f"{name}: listed in files_sha256 (sha256 {want}) but cannot be read ({exc})")
            continue
        if found != want:
            problems.append(f"{name}: expected sha256 {want} (manifest), found {found} ({stamp.size:,} bytes)")
    cache.save()
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise EngineIntegrityError(
            f"{engine_dir}: the engine's files do not match its {MANIFEST} (files_sha256); refusing to load it:\n"
            f"{lines}\nThe engine was altered or damaged after it was built: {_rebuild(engine_dir, manifest)} "
            "(or restore an intact copy)."
        )
    result = Verification(mode, checked, hashed, hashed_bytes, time.monotonic() - start)
    log.info("verified %d files of %s against its manifest (%s): %d hashed (%.2f GB), %d unchanged since cached, "
             "%.2f s", checked, engine_dir, mode, hashed, hashed_bytes / 1e9, checked - hashed,
             result.seconds)  # fmt: skip
    return result


def _rebuild(engine_dir: Path, manifest: Mapping[str, Any]) -> str:
    source = manifest.get("source")
    model = source.get("model") if isinstance(source, Mapping) else None
    return f"rebuild it with: build-engine --model {model if isinstance(model, str) else '...'} --output {engine_dir}"
