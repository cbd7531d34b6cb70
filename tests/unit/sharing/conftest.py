"""Fixtures of the sharing tests: the engine's (``tests.unit.node.engine_support``)."""

from tests.unit.node.engine_support import api_client, apiserver, kubeconfig  # noqa: F401
