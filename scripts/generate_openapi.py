#!/usr/bin/env python3
"""Regenerate the OpenAPI schemas the embedded API server serves, into
agent/sim/apiserver/schemas/.

    python scripts/generate_openapi.py           # rewrite the schema files
    python scripts/generate_openapi.py --check   # exit 1 when they are stale

The built-in kinds' schemas come from kubernetes-validate (requirements-dev.lock), which ships
the upstream Kubernetes OpenAPI definitions of every release as JSON Schema: for each release
the server answers as (1.34-1.37) this keeps the definitions the served kinds reach (the kinds
of agent.sim.apiserver.kinds, their lists and the meta types every group-version document
names) and turns them back into OpenAPI 3 component schemas (no ``null`` types, references to
``#/components/schemas/``, a reference with a description of its own wrapped in ``allOf``, as
kube-apiserver writes it). Our CRDs' schemas and printer columns are copied from
deploy/kubernetes/crds/. The files are committed, so that the simulator needs neither
kubernetes-validate nor the deploy/ folder at run time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.sim.apiserver.kinds import DEFAULT_KINDS  # noqa: E402

OUTPUT_DIR = ROOT / "agent" / "sim" / "apiserver" / "schemas"
CRD_DIR = ROOT / "deploy" / "kubernetes" / "crds"
RELEASES = ("1.34", "1.35", "1.36", "1.37")
META = "io.k8s.apimachinery.pkg.apis.meta.v1."
EXTRA_ROOTS = tuple(META + n for n in ("Status", "DeleteOptions", "WatchEvent", "Patch"))
_REF = re.compile(r"#/\$defs/([A-Za-z0-9_.\-]+)")
Obj = dict[str, Any]


def _definitions(release: str) -> Obj:
    root = Path(str(files("kubernetes_validate"))) / "kubernetes-json-schema"
    data = json.loads((root / f"v{release}.0-local" / "_definitions.json").read_text())
    defs: Obj = data["$defs"]
    return defs


def _gvk_names(defs: Obj) -> dict[tuple[str, str, str], str]:
    out: dict[tuple[str, str, str], str] = {}
    for name, schema in defs.items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            out.setdefault((gvk["group"], gvk["version"], gvk["kind"]), name)
    return out


def _closure(defs: Obj, roots: list[str]) -> list[str]:
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        stack.extend(_REF.findall(json.dumps(defs[name])))
    return sorted(seen)


def _openapi(node: Any, *, top: bool = False) -> Any:
    """One JSON Schema node of kubernetes-validate as the OpenAPI 3 node upstream has."""
    if isinstance(node, list):
        return [_openapi(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: Obj = {}
    for key, value in node.items():
        if key == "type" and isinstance(value, list):
            kept = [t for t in value if t != "null"]
            out[key] = kept[0] if len(kept) == 1 else kept
        elif key == "$ref":
            out[key] = "#/components/schemas/" + _REF.fullmatch(value)[1]  # type: ignore[index]
        elif key == "properties":
            out[key] = {
                name: _property(name, prop, top=top) for name, prop in sorted(value.items())
            }
        else:
            out[key] = _openapi(value)
    if "$ref" in out and len(out) > 1:  # a described reference: allOf, as upstream writes it
        out = {"allOf": [{"$ref": out.pop("$ref")}], **out}
    return out


def _property(name: str, prop: Any, *, top: bool) -> Any:
    converted = _openapi(prop)
    if top and name in ("apiVersion", "kind") and isinstance(converted, dict):
        converted.pop("enum", None)  # kubernetes-validate's addition, not upstream's
    return converted


def _int_or_string(schema: Obj) -> Obj:
    types = sorted(s.get("type", "") for s in schema.get("oneOf", []))
    if types == ["integer", "string"]:
        return {"format": "int-or-string", "oneOf": [{"type": "integer"}, {"type": "string"}]}
    return schema


def built_in(release: str) -> Obj:
    defs = _definitions(release)
    names = _gvk_names(defs)
    roots: list[str] = list(EXTRA_ROOTS)
    for kind in DEFAULT_KINDS:
        if kind.custom:
            continue
        for suffix in ("", "List"):
            roots.append(names[(kind.group, kind.version, kind.kind + suffix)])
    schemas = {
        name: _int_or_string(_openapi(defs[name], top=True)) for name in _closure(defs, roots)
    }
    return {
        "release": release,
        "source": "kubernetes-validate (upstream Kubernetes OpenAPI definitions)",
        "schemas": schemas,
    }


def crds() -> list[Obj]:
    out: list[Obj] = []
    for path in sorted(CRD_DIR.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
            continue
        spec = doc["spec"]
        for version in spec["versions"]:
            out.append(
                {
                    "group": spec["group"],
                    "version": version["name"],
                    "kind": spec["names"]["kind"],
                    "plural": spec["names"]["plural"],
                    "scope": spec["scope"],
                    "additionalPrinterColumns": version.get("additionalPrinterColumns", []),
                    "subresources": version.get("subresources", {}),
                    "schema": version["schema"]["openAPIV3Schema"],
                }
            )
    return out


def rendered() -> dict[str, bytes]:
    """File name -> exact bytes (gzip without a timestamp, so the output is reproducible)."""
    out: dict[str, bytes] = {}
    for release in RELEASES:
        text = json.dumps(built_in(release), sort_keys=True, separators=(",", ":"))
        out[f"kubernetes-{release}.json.gz"] = gzip.compress(text.encode(), 9, mtime=0)
    out["crds.json"] = (json.dumps(crds(), indent=1, sort_keys=True) + "\n").encode()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the files are stale")
    args = parser.parse_args()
    wanted = rendered()
    if args.check:
        stale = [
            name
            for name, data in wanted.items()
            if not (OUTPUT_DIR / name).is_file() or (OUTPUT_DIR / name).read_bytes() != data
        ]
        if stale:
            print(f"stale: {', '.join(stale)}; run python scripts/generate_openapi.py")
            return 1
        return 0
    OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, data in wanted.items():
        (OUTPUT_DIR / name).write_bytes(data)
        print(f"wrote {OUTPUT_DIR / name} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
