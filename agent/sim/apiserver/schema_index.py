"""The OpenAPI schemas of the served kinds, loaded on first use, per Kubernetes release.

kubectl validates, explains and computes patches from the server's OpenAPI documents, and the
server itself needs the same schemas for strict field validation (``fieldValidation=Strict``)
and server-side apply (which fields a list's items are keyed by). The built-in kinds' schemas
are generated once from kubernetes-validate into ``schemas/kubernetes-<release>.json.gz``
(``scripts/generate_openapi.py``), our CRDs' into ``schemas/crds.json``; nothing is read until
a request needs it, so neither the agent nor an idle simulator pays for them.
"""

from __future__ import annotations

import copy
import gzip
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib.resources import files
from typing import Any

Obj = dict[str, Any]
RELEASES = ("1.34", "1.35", "1.36", "1.37")
REF_PREFIX = "#/components/schemas/"
META = "io.k8s.apimachinery.pkg.apis.meta.v1."
_OBJECT_META_DOC = (
    "Standard object's metadata. More info: "
    "https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md#metadata"
)
_API_VERSION_DOC = (
    "APIVersion defines the versioned schema of this representation of an object. Servers "
    "should convert recognized schemas to the latest internal value, and may reject "
    "unrecognized values."
)
_KIND_DOC = (
    "Kind is a string value representing the REST resource this object represents. Servers "
    "may infer this from the endpoint the client submits requests to. In CamelCase."
)


def release_for(kubernetes_version: str) -> str:
    """The schema release for a server version: its minor, held to 1.34-1.37."""
    match = re.match(r"^v?1\.(\d+)", kubernetes_version)
    minor = int(match[1]) if match else 35
    low, high = (int(r.split(".")[1]) for r in (RELEASES[0], RELEASES[-1]))
    return f"1.{min(max(minor, low), high)}"


@dataclass(frozen=True)
class CrdVersion:
    """One served version of one of our CRDs (deploy/kubernetes/crds)."""

    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool
    columns: tuple[Obj, ...]
    schema: Obj

    @property
    def schema_name(self) -> str:
        """The component name kube-apiserver gives a CRD: the group reversed, version, kind."""
        return ".".join([*reversed(self.group.split(".")), self.version, self.kind])


@lru_cache(maxsize=1)
def crd_versions() -> tuple[CrdVersion, ...]:
    text = (files("agent.sim.apiserver") / "schemas" / "crds.json").read_text()
    return tuple(
        CrdVersion(
            crd["group"],
            crd["version"],
            crd["kind"],
            crd["plural"],
            crd["scope"] == "Namespaced",
            tuple(crd["additionalPrinterColumns"]),
            crd["schema"],
        )
        for crd in json.loads(text)
    )


def crd_for(group: str, version: str, kind: str) -> CrdVersion | None:
    for crd in crd_versions():
        if (crd.group, crd.version, crd.kind) == (group, version, kind):
            return crd
    return None


def _gvk(group: str, version: str, kind: str) -> list[Obj]:
    return [{"group": group, "kind": kind, "version": version}]


def _crd_schemas(crd: CrdVersion) -> dict[str, Obj]:
    """The CRD's object and list schemas as kube-apiserver publishes them: metadata is
    ObjectMeta, apiVersion and kind are described, the GVK extension names the kind."""
    schema = copy.deepcopy(crd.schema)
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"description": _API_VERSION_DOC, "type": "string"}
    props["kind"] = {"description": _KIND_DOC, "type": "string"}
    props["metadata"] = {
        "allOf": [{"$ref": REF_PREFIX + META + "ObjectMeta"}],
        "description": _OBJECT_META_DOC,
    }
    schema["x-kubernetes-group-version-kind"] = _gvk(crd.group, crd.version, crd.kind)
    listed = {
        "description": f"{crd.kind}List is a list of {crd.kind}",
        "properties": {
            "apiVersion": props["apiVersion"],
            "items": {
                "description": f"List of {crd.plural}.",
                "items": {"$ref": REF_PREFIX + crd.schema_name},
                "type": "array",
            },
            "kind": props["kind"],
            "metadata": {"allOf": [{"$ref": REF_PREFIX + META + "ListMeta"}]},
        },
        "required": ["items"],
        "type": "object",
        "x-kubernetes-group-version-kind": _gvk(crd.group, crd.version, crd.kind + "List"),
    }
    return {crd.schema_name: schema, crd.schema_name + "List": listed}


class SchemaIndex:
    """Every component schema of one release, by name and by group/version/kind."""

    def __init__(self, release: str, schemas: dict[str, Obj]) -> None:
        self.release = release
        self.schemas = schemas
        self._by_gvk: dict[tuple[str, str, str], str] = {}
        for name, schema in schemas.items():
            for gvk in schema.get("x-kubernetes-group-version-kind", []):
                self._by_gvk.setdefault((gvk["group"], gvk["version"], gvk["kind"]), name)

    def name_for(self, group: str, version: str, kind: str) -> str | None:
        return self._by_gvk.get((group, version, kind))

    def schema_for(self, group: str, version: str, kind: str) -> Obj | None:
        name = self.name_for(group, version, kind)
        return None if name is None else self.schemas[name]

    def resolve(self, node: Obj) -> Obj:
        """Follow a described reference (``allOf`` of one) and ``$ref`` to the schema itself."""
        seen = 0
        while seen < 32:
            seen += 1
            if len(node.get("allOf", ())) == 1 and "properties" not in node:
                node = node["allOf"][0]
            elif "$ref" in node:
                node = self.schemas[str(node["$ref"]).removeprefix(REF_PREFIX)]
            else:
                return node
        return node

    def description(self, name: str, prop: str) -> str:
        """A property's description, for table columns named after API fields."""
        schema = self.schemas.get(name, {})
        node = schema.get("properties", {}).get(prop, {})
        return str(node.get("description", ""))

    def closure(self, roots: list[str]) -> list[str]:
        """The named schemas and every schema they reach, sorted."""
        seen: set[str] = set()
        stack = [r for r in roots if r in self.schemas]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            stack.extend(
                ref
                for ref in re.findall(
                    r'"#/components/schemas/([^"]+)"', json.dumps(self.schemas[name])
                )
                if ref not in seen
            )
        return sorted(seen)


@lru_cache(maxsize=4)
def schema_index(release: str) -> SchemaIndex:
    """The release's schemas (built-in and CRDs); read and cached on first use."""
    if release not in RELEASES:
        raise ValueError(f"no OpenAPI schemas for Kubernetes {release}; shipped: {RELEASES}")
    data = (files("agent.sim.apiserver") / "schemas" / f"kubernetes-{release}.json.gz").read_bytes()
    schemas: dict[str, Obj] = json.loads(gzip.decompress(data))["schemas"]
    for crd in crd_versions():
        schemas.update(_crd_schemas(crd))
    return SchemaIndex(release, schemas)
