"""Short names for the generated kubelet protocol packages.

The betterproto2 code lives in ``agent._proto`` under the proto package paths (for example
``agent._proto.k8s.io.kubelet.pkg.apis.dra.v1``); everything else imports it from here.
Regenerate it with ``python scripts/generate_proto.py``.

betterproto2 imports pydantic when it is installed (pydantic_core's schemas: some 40 ms and
4 MB of a start), for messages generated as pydantic dataclasses; this code is generated
without them, so betterproto2 is imported here with pydantic out of sight. Where pydantic or
betterproto2 was imported before (a test process), nothing changes.
"""

import sys

if "betterproto2" not in sys.modules and "pydantic" not in sys.modules:
    sys.modules["pydantic"] = None  # type: ignore[assignment]  # `import pydantic` fails
    try:
        import betterproto2  # noqa: F401
    finally:
        del sys.modules["pydantic"]

from agent._proto import pluginregistration
from agent._proto import v1 as health_v1
from agent._proto import v1alpha1 as health_v1alpha1
from agent._proto.k8s.io.kubelet.pkg.apis.dra import v1 as dra_v1
from agent._proto.k8s.io.kubelet.pkg.apis.dra import v1beta1 as dra_v1beta1

#: PluginInfo.type of a DRA plugin.
DRA_PLUGIN_TYPE = "DRAPlugin"
#: Version strings for PluginInfo.supported_versions (not full gRPC service names).
DRA_V1_SERVICE = "v1.DRAPlugin"
DRA_V1BETA1_SERVICE = "v1beta1.DRAPlugin"
HEALTH_V1ALPHA1_SERVICE = "v1alpha1.DRAResourceHealth"
HEALTH_V1_SERVICE = "v1.DRAResourceHealth"

__all__ = [
    "DRA_PLUGIN_TYPE",
    "DRA_V1BETA1_SERVICE",
    "DRA_V1_SERVICE",
    "HEALTH_V1ALPHA1_SERVICE",
    "HEALTH_V1_SERVICE",
    "dra_v1",
    "dra_v1beta1",
    "health_v1",
    "health_v1alpha1",
    "pluginregistration",
]
