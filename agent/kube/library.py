"""kubernetes-asyncio, loaded by the parts the agent uses and no more.

The library's package ``__init__`` files import every generated API class and every model
(about 800 modules): half a second of the agent's start and some 40 MB of its resident memory,
for a client that the agent uses through five API classes with ``_preload_content=False``
(raw JSON, no model ever built). Importing any submodule runs those ``__init__`` files first.

So before the first import, :func:`_defer` puts the library's packages into ``sys.modules``
as module objects whose ``__init__`` has not run yet: a submodule imports as usual (its parent
is found there), the few names listed in ``_LIGHT`` come from the submodule that defines them,
and the first other name read from such a package (``client.V1Pod``, ``client.models.V1Node``:
a deserializing call, a test or a simulator in the same process) runs the package's own
``__init__`` then and there, so every name the library exports is still there, only later.
When the library was imported before this module (a test process), nothing is deferred.

Only this module names the library's submodules; the rest of the agent imports from here.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

#: The packages whose ``__init__`` is deferred, parents before children.
_DEFERRED = (
    "kubernetes_asyncio",
    "kubernetes_asyncio.client",
    "kubernetes_asyncio.client.api",
    "kubernetes_asyncio.client.models",
    "kubernetes_asyncio.config",
)
#: Names a deferred package hands out without running its ``__init__``: name -> submodule.
_LIGHT = {
    "kubernetes_asyncio.client": {
        "ApiClient": "api_client",
        "Configuration": "configuration",
        "ApiException": "exceptions",
    },
}


def _defer(name: str) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not a package")
    module = importlib.util.module_from_spec(spec)
    light = _LIGHT.get(name, {})

    def complete(attribute: str) -> Any:
        if attribute in light:
            value = getattr(importlib.import_module(f"{name}.{light[attribute]}"), attribute)
            setattr(module, attribute, value)
            return value
        if not attribute.startswith("__") and importlib.util.find_spec(f"{name}.{attribute}"):
            return importlib.import_module(f"{name}.{attribute}")  # ``from package import sub``
        # any other name: the package's own __init__ runs now (once), then it is looked up
        del module.__dict__["__getattr__"]
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(module)
        return getattr(module, attribute)

    module.__dict__["__getattr__"] = complete
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def _load() -> ModuleType:
    for name in _DEFERRED:
        _defer(name)
    return sys.modules["kubernetes_asyncio"]


_load()

# ruff: noqa: E402 (the submodules are imported after their packages were deferred)
from kubernetes_asyncio.client.api.coordination_v1_api import CoordinationV1Api
from kubernetes_asyncio.client.api.core_v1_api import CoreV1Api
from kubernetes_asyncio.client.api.custom_objects_api import CustomObjectsApi
from kubernetes_asyncio.client.api.resource_v1_api import ResourceV1Api
from kubernetes_asyncio.client.api.version_api import VersionApi
from kubernetes_asyncio.client.api_client import ApiClient
from kubernetes_asyncio.client.configuration import Configuration
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.config.incluster_config import load_incluster_config
from kubernetes_asyncio.config.kube_config import load_kube_config

__all__ = [
    "ApiClient",
    "ConfigException",
    "Configuration",
    "CoordinationV1Api",
    "CoreV1Api",
    "CustomObjectsApi",
    "ResourceV1Api",
    "VersionApi",
    "load_incluster_config",
    "load_kube_config",
]
