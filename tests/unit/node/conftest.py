"""Fixtures of the prepare-engine tests (defined in ``engine_support``), shared by this folder."""

from tests.unit.node.engine_support import (  # noqa: F401
    a100_host,
    a100_node,
    engine,
    h100_host,
    node,
)
