"""Hostile-input tests: property-based (hypothesis) and mutation fuzzing of every input the
agent takes from outside its own process.

What is fuzzed, one module each:

- ``test_grpc_surface``: the kubelet-facing gRPC API of the real ``gpu-dra-agent run``
  process over its real unix DRA socket, through a raw grpcio channel (identity
  serializers, so the bytes on the wire are exactly what hypothesis drew): random bytes,
  mutated valid ``NodePrepareResourcesRequest``/``NodeUnprepareResourcesRequest`` bodies
  (v1 and v1beta1), requests at and beyond the 4 MiB receive limit (RESOURCE_EXHAUSTED),
  10 000 claims in one request, very long strings and invalid UTF-8. Afterwards the
  process is still up, prepares a normal claim correctly, its RSS stayed under
  ``RSS_LIMIT_MB``, and nothing outside its plugin, CDI and registry directories changed.
  Any interleaving of prepares of claims allocated one exclusive device gives it to at
  most one of them.
- ``test_configs``: the opaque config decoders (``GpuConfig``, ``MigDeviceConfig``,
  sharing, ``ComputeDomainChannelConfig``) on random JSON and mutated valid configs: a
  ``ConfigError`` whose every problem starts with a field path, or a config, never another
  exception; whole ResourceClaim documents into planning: a plan or a per-claim error.
- ``test_files``: the checkpoint and CDI spec files truncated at every offset, bit-flipped,
  with wrong JSON types, the wrong owner, symlinks planted in place of them, of their
  temporaries and of the node lock: the engine starts, reports what it found, keeps
  serving, and never writes through a symlink (its target outside stays byte-identical).
- ``test_nvml_errors``: every NVML C function the agent calls (recorded, not listed by
  hand) failing with every error code pynvml defines, through the real pynvml bindings
  over the simulated library: discovery, health and MIG operations fail with a precise
  ``HardwareError`` (or degrade as documented), never another exception; a dynamic MIG
  prepare answers a per-claim error and its retry succeeds.

Run them alone with ``.venv/bin/python -m pytest -q tests/fuzz``. The number of examples
per property is small in CI (``FUZZ_SETTINGS``, derandomized so a run is repeatable);
``GPU_DRA_FUZZ_EXAMPLES=2000`` (say) runs that many per property with fresh random seeds,
and a failure prints the smallest input hypothesis found plus the ``@reproduce_failure``
line to replay it. The bounds each test states are in ``docs/RELIABILITY.md`` ("Hostile
input").
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

#: Examples per property: GPU_DRA_FUZZ_EXAMPLES, else a CI-sized default.
EXAMPLES = int(os.environ.get("GPU_DRA_FUZZ_EXAMPLES", "0")) or None
CI_EXAMPLES = 60


def fuzz_settings(ci_examples: int = CI_EXAMPLES) -> settings:
    """Settings of one property: ``ci_examples`` derandomized examples unless
    GPU_DRA_FUZZ_EXAMPLES asks for more (then random seeds and that many examples)."""
    return settings(
        max_examples=EXAMPLES or ci_examples,
        derandomize=EXAMPLES is None,
        deadline=None,
        database=None if EXAMPLES is None else settings().database,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
        print_blob=True,
    )
