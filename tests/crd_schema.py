"""Validate a custom resource against its CRD's ``openAPIV3Schema`` with jsonschema, strictly.

Kubernetes' structural schemas are OpenAPI v3; the differences from JSON Schema that matter are
mapped here: ``nullable``, ``x-kubernetes-int-or-string`` and ``x-kubernetes-preserve-unknown-fields``.
Objects that list ``properties`` reject unknown fields, as ``kubectl apply --validate=strict``
does (the API server would otherwise prune them silently). CEL rules (``x-kubernetes-validations``)
compare old and new objects and are not checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import yaml


def to_json_schema(node: Any) -> Any:
    """The JSON Schema of an OpenAPI v3 structural schema node."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def crd_validator(crd_path: Path, version: str) -> jsonschema.protocols.Validator:
    """A validator of ``version`` objects of the CRD in ``crd_path``."""
    crd = next(d for d in yaml.safe_load_all(crd_path.read_text()) if d and d.get("kind") == "CustomResourceDefinition")
    spec = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    schema = to_json_schema(spec["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta is checked by the API server
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def errors(validator: jsonschema.protocols.Validator, obj: dict) -> list[str]:
    """Every schema error of ``obj`` as ``path: message``."""
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]
