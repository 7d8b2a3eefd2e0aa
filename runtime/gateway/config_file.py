"""Reading the gateway's config files (.yaml/.yml or .toml): the whole config (routing.GatewayConfig.load)
or a tenants file (`trtserve gateway --tenants`, tenants.tenants_file).

YAML is read with duplicate keys refused (PyYAML would keep the last one silently: a tenant listed twice
would lose its first key without a word); TOML needs Python 3.11's tomllib.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def read_file(path: str | Path, build: Callable[[object], T]) -> T:
    """`build` applied to a .yaml/.yml or .toml file's contents; ValueError (prefixed with the path) names what
    is wrong."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ValueError(f"{path}: unknown config format {suffix!r} (expected .yaml, .yml or .toml)")
    text = path.read_text(encoding="utf-8")
    try:
        data = _parse_toml(text) if suffix == ".toml" else yaml.load(text, Loader=_UniqueKeyLoader)
        return build(data)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML: {exc}") from None
    except ValueError as exc:  # includes tomllib.TOMLDecodeError
        raise ValueError(f"{path}: {exc}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _parse_toml(text: str) -> object:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads(text)
    raise ValueError("TOML configs need Python >= 3.11 (tomllib); use a .yaml config")
