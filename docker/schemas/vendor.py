"""Regenerate the vendored JSON schemas from upstream CustomResourceDefinitions (run by hand, offline).

    python docker/schemas/vendor.py CRD.yaml VERSION OUT.json [CRD.yaml VERSION OUT.json ...]

A CRD's openAPIV3Schema becomes a standalone JSON schema, made strict the way `kubectl apply
--validate=strict` is: unknown fields are errors (the API server would drop them silently), `apiVersion`
and `kind` must be this CRD's, `metadata.name` is required. Descriptions are dropped (size).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import yaml

METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def strict(node: Any) -> Any:
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict(value) for key, value in node.items() if key != "description"}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    preserve = out.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def crd_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    spec = crd["spec"]
    [served] = [v for v in spec["versions"] if v["name"] == version]
    schema = strict(copy.deepcopy(served["schema"]["openAPIV3Schema"]))
    schema["properties"].update(
        apiVersion={"const": f"{spec['group']}/{version}"}, kind={"const": spec["names"]["kind"]}, metadata=METADATA
    )
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    title = f"{spec['names']['kind']} {spec['group']}/{version} (from {crd['metadata']['name']}, strict)"
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": title, **schema}


def main(args: list[str]) -> None:
    if not args or len(args) % 3:
        raise SystemExit(__doc__)
    for crd_path, version, out in zip(args[::3], args[1::3], args[2::3], strict=True):
        docs = yaml.safe_load_all(Path(crd_path).read_text())
        crd = next(d for d in docs if d and d.get("kind") == "CustomResourceDefinition")
        Path(out).write_text(json.dumps(crd_schema(crd, version), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
