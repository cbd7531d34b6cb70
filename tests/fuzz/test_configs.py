"""Opaque device configs from users: random and mutated JSON into the strict decoders.

A claim's ``parameters`` are whatever a user (or a buggy controller) wrote. The decoders
promise one outcome for bad input: ``ConfigError`` whose every problem starts with the
field path it is about (``parameters``, ``devices.config[2].opaque.parameters.sharing...``),
so the pod's events say where the mistake is. Any other exception would fail the whole
prepare batch with an internal error instead of a per-claim message, and a decode that
takes seconds (a quantity such as ``1e999999999``) would stall every prepare behind it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from agent.dra.config import (
    API_VERSION,
    MAX_PARAMETERS_BYTES,
    AllocationResult,
    ConfigError,
    DeviceConfigEntry,
    GpuConfig,
    MigDeviceConfig,
    MpsConfig,
    Sharing,
    SharingStrategy,
    TimeSliceInterval,
    TimeSlicingConfig,
    config_to_dict,
    decode_parameters,
    effective_configs,
    parse_allocation,
)
from agent.dra.errors import InvalidValueError
from agent.dra.quantity import parse_quantity
from agent.imex.config import (
    DRIVER as CHANNEL_DRIVER,
)
from agent.imex.config import (
    ChannelConfig,
    channel_config_for,
    decode_channel_config,
)
from agent.node.checkpoint import (
    Checkpoint,
    ClaimState,
    MigInstance,
    PreparedClaim,
    PreparedDevice,
    encode,
    from_dict,
)
from agent.node.plan import PrepareRefused, node_devices, plan_claim
from agent.node.types import ClaimRef
from tests.fuzz import fuzz_settings
from tests.support.inventories import h100_mixed_mig_node

#: A decode of at most MAX_PARAMETERS_BYTES must take no longer than this (it runs inside
#: a prepare, under the node lock).
DECODE_LIMIT_S = 0.5
DRIVER = "gpu.nvidia.com"
DOMAIN = "3f2a9c1e-7b4d-4e8a-9c1f-2d5e6f7a8b9c"

# -- strategies -------------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.sampled_from(
        [
            "GpuConfig",
            "MigDeviceConfig",
            "ComputeDomainChannelConfig",
            API_VERSION,
            "MPS",
            "TimeSlicing",
            "Short",
            "Single",
            "All",
            "8Gi",
            "1e999999999",
            "-1",
            "0",
            "GPU-x",
            "MIG-y",
            "1",
            DOMAIN,
            "\udcff",
        ]
    ),
)
json_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=12), inner, max_size=4),
    ),
    max_leaves=20,
)

_quantities = st.one_of(
    st.sampled_from(["8Gi", "1024Mi", "0", "500M", "1.5G", "1e3", "100m"]),
    st.integers(min_value=0, max_value=2**40),
)
_mps = st.fixed_dictionaries(
    {},
    optional={
        "defaultActiveThreadPercentage": st.integers(min_value=0, max_value=100),
        "defaultPinnedDeviceMemoryLimit": _quantities,
        "defaultPerDevicePinnedMemoryLimit": st.dictionaries(
            st.sampled_from(["0", "1", "GPU-4d5e", "MIG-77aa"]), _quantities, max_size=3
        ),
    },
)
_sharing = st.one_of(
    st.fixed_dictionaries(
        {"strategy": st.just("TimeSlicing")},
        optional={
            "timeSlicingConfig": st.fixed_dictionaries(
                {}, optional={"interval": st.sampled_from(["Default", "Short", "Medium", "Long"])}
            )
        },
    ),
    st.fixed_dictionaries({"strategy": st.just("MPS")}, optional={"mpsConfig": _mps}),
)
valid_gpu_configs = st.builds(
    lambda kind, sharing: {
        "apiVersion": API_VERSION,
        "kind": kind,
        **({"sharing": sharing} if sharing is not None else {}),
    },
    st.sampled_from(["GpuConfig", "MigDeviceConfig"]),
    st.one_of(st.none(), _sharing),
).filter(lambda c: c["kind"] == "GpuConfig" or "timeSlicingConfig" not in c.get("sharing", {}))
valid_channel_configs = st.builds(
    lambda mode: {
        "apiVersion": API_VERSION,
        "kind": "ComputeDomainChannelConfig",
        "domainID": DOMAIN,
        **({"allocationMode": mode} if mode else {}),
    },
    st.sampled_from(["", "Single", "All"]),
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a JSON value (objects and arrays), the root included."""
    found = [prefix]
    if isinstance(value, Mapping):
        for key, inner in value.items():
            found += _paths(inner, (*prefix, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            found += _paths(inner, (*prefix, index))
    return found


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> Any:
    """A valid config with a few structural mutations: a value replaced by random JSON, a key
    dropped, renamed or added, a type swapped (list for object, string for number)."""
    document: Any = json.loads(json.dumps(draw(valid)))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        path = draw(st.sampled_from(_paths(document)))
        if not path:
            document = draw(json_values)
            continue
        parent = document
        for step in path[:-1]:
            parent = parent[step]
        key = path[-1]
        action = draw(st.sampled_from(["replace", "drop", "rename", "add", "wrap", "stringify"]))
        if action == "replace":
            parent[key] = draw(json_values)
        elif action == "drop" and isinstance(parent, dict):
            del parent[key]
        elif action == "rename" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = parent.pop(key)
        elif action == "add" and isinstance(parent[key], dict):
            parent[key][draw(st.text(max_size=8))] = draw(json_values)
        elif action == "wrap":
            parent[key] = [parent[key]]
        elif action == "stringify":
            parent[key] = json.dumps(parent[key])
    return document


@st.composite
def mutated_bytes(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> bytes:
    """The JSON text of a valid config with byte-level mutations: truncation, bit flips,
    inserted bytes (invalid UTF-8 included), a duplicated slice."""
    data = bytearray(json.dumps(draw(valid)).encode())
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        at = draw(st.integers(min_value=0, max_value=max(len(data) - 1, 0)))
        action = draw(st.sampled_from(["truncate", "flip", "insert", "duplicate"]))
        if action == "truncate":
            del data[at:]
        elif action == "flip" and data:
            data[at] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif action == "duplicate":
            data[at:at] = data[at : at + draw(st.integers(min_value=1, max_value=32))]
    return bytes(data)


hostile_parameters = st.one_of(
    json_values,
    mutated(valid_gpu_configs),
    mutated(valid_channel_configs),
    mutated_bytes(valid_gpu_configs),
    mutated_bytes(valid_channel_configs),
    st.binary(max_size=64),
    st.text(max_size=64),
)

# -- properties -------------------------------------------------------------------------------

DEEP = b"[" * (MAX_PARAMETERS_BYTES // 2 - 1) + b"]" * (MAX_PARAMETERS_BYTES // 2 - 1)
DEEP_OBJECT = b'{"a":' * 1700 + b"1" + b"}" * 1700
HUGE_EXPONENT = {
    "apiVersion": API_VERSION,
    "kind": "GpuConfig",
    "sharing": {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1e999999999"}},
}


def _assert_precise(error: ConfigError, path: str) -> None:
    assert error.problems, error
    for problem in error.problems:
        assert problem.startswith(path), (path, problem)


def _decode_timed(decoder: Any, parameters: Any, path: str) -> Any:
    started = time.perf_counter()
    try:
        return decoder(parameters, path)
    finally:
        elapsed = time.perf_counter() - started
        assert elapsed < DECODE_LIMIT_S, f"decoding took {elapsed:.2f} s: {parameters!r:.200}"


@fuzz_settings(ci_examples=300)
@given(hostile_parameters)
@example(DEEP)
@example(DEEP_OBJECT)
@example(b"\xff\xfe{}")
@example('{"kind": "GpuConfig\udcff"}')
@example(HUGE_EXPONENT)
def test_gpu_config_decoding_is_precise(parameters: Any) -> None:
    """``decode_parameters``: a config that reads back to itself, or ConfigError by path."""
    path = "devices.config[3].opaque.parameters"
    try:
        config = _decode_timed(decode_parameters, parameters, path)
    except ConfigError as error:
        _assert_precise(error, path)
        return
    assert isinstance(config, GpuConfig | MigDeviceConfig)
    assert decode_parameters(config_to_dict(config)) == config


@fuzz_settings(ci_examples=200)
@given(hostile_parameters)
@example(DEEP)
@example(
    {
        "apiVersion": API_VERSION,
        "kind": "ComputeDomainChannelConfig",
        "domainID": DOMAIN,
        "allocationMode": [],
    }
)
@example({"allocationMode": {"Single": 1}})
def test_channel_config_decoding_is_precise(parameters: Any) -> None:
    """``decode_channel_config``: a channel config that reads back, or ConfigError by path."""
    path = "devices.config[0].parameters"
    try:
        config = _decode_timed(decode_channel_config, parameters, path)
    except ConfigError as error:
        _assert_precise(error, path)
        return
    assert isinstance(config, ChannelConfig)
    assert decode_channel_config(config.to_dict()) == config


def test_valid_configs_decode() -> None:
    """The generators of valid configs really are valid (else the mutations test nothing)."""

    @fuzz_settings(ci_examples=50)
    @given(valid_gpu_configs, valid_channel_configs)
    def check(gpu: dict[str, Any], channel: dict[str, Any]) -> None:
        assert config_to_dict(decode_parameters(gpu))["kind"] == gpu["kind"]
        assert decode_channel_config(channel).domain_id == DOMAIN

    check()


_allocation_entries = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {
            "source": st.sampled_from(["FromClaim", "FromClass", "FromNowhere", 3]),
            "requests": st.one_of(st.lists(st.sampled_from(["gpu", "gpu/a", "mig"])), json_values),
            "opaque": st.one_of(
                st.fixed_dictionaries(
                    {
                        "driver": st.sampled_from([DRIVER, CHANNEL_DRIVER, "other.example.com"]),
                        "parameters": hostile_parameters.filter(
                            lambda p: not isinstance(p, str | bytes)
                        ),
                    }
                ),
                json_values,
            ),
        }
    ),
)
allocations = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {
            "devices": st.one_of(
                json_values,
                st.fixed_dictionaries(
                    {
                        "results": st.one_of(
                            json_values,
                            st.lists(
                                st.one_of(
                                    json_values,
                                    st.fixed_dictionaries(
                                        {
                                            "request": st.sampled_from(["gpu", "gpu/a", "mig", ""]),
                                            "driver": st.sampled_from([DRIVER, CHANNEL_DRIVER]),
                                            "pool": st.sampled_from(["node-a", "node-b"]),
                                            "device": st.sampled_from(["gpu-0", "gpu-1-mig-1"]),
                                        },
                                        optional={"adminAccess": json_values},
                                    ),
                                ),
                                max_size=3,
                            ),
                        ),
                        "config": st.one_of(json_values, st.lists(_allocation_entries, max_size=3)),
                    }
                ),
            )
        }
    ),
)


@fuzz_settings(ci_examples=300)
@given(allocations)
@example({"devices": {"results": 7}})
@example({"devices": {"results": [], "config": True}})
@example({"devices": {"results": "gpu-0"}})
@example({"devices": {"results": [], "config": [{"source": ["FromClaim"]}]}})
def test_allocation_and_precedence_are_precise(allocation: Any) -> None:
    """A claim's ``status.allocation`` as the API could hold it after a bad write: parsing it
    and choosing each result's config (GPU and channel) raise only ConfigError."""
    try:
        results, configs = parse_allocation(allocation)
    except ConfigError as error:
        assert error.problems and all(
            p.startswith(("allocation.", "devices.")) for p in error.problems
        )
        return
    assert all(isinstance(r, AllocationResult) for r in results)
    assert all(isinstance(c, DeviceConfigEntry) for c in configs)

    def kind_of(_pool: str, device: str) -> Any:
        return {"gpu-0": "gpu", "gpu-1-mig-1": "mig"}.get(device)

    try:
        chosen = effective_configs(results, configs, DRIVER, kind_of, claim="default/c")
    except ConfigError as error:
        assert error.problems and all(p.startswith("devices.") for p in error.problems), error
    else:
        assert len(chosen) == sum(r.driver == DRIVER for r in results)
    for result in results:
        if result.driver != CHANNEL_DRIVER:
            continue
        try:
            channel = channel_config_for(result, configs, claim="default/c")
        except ConfigError as error:
            assert error.problems, error
            assert all(p.startswith(("devices.config[", "request ")) for p in error.problems)
        else:
            assert channel.domain_id == DOMAIN


@pytest.mark.parametrize(
    "text",
    ["1e999999999", "1E-999999999", "5e4000", "1e" + "9" * 400, "9" * 5000 + "Ki"],
)
def test_quantity_parsing_is_bounded(text: str) -> None:
    """A quantity's exponent is bounded: parsing never computes a number of millions of
    digits (that took seconds per claim, under the node lock) but names the problem."""
    started = time.perf_counter()
    try:
        value = parse_quantity(text)
    except InvalidValueError as error:
        assert repr(text)[:20] in str(error) or "exponent" in str(error)
    else:
        assert value >= 0
    assert time.perf_counter() - started < DECODE_LIMIT_S


@pytest.mark.parametrize(
    "config",
    [
        MigDeviceConfig(Sharing(SharingStrategy.TIME_SLICING)),
        GpuConfig(Sharing(SharingStrategy.TIME_SLICING, TimeSlicingConfig(TimeSliceInterval.LONG))),
        MigDeviceConfig(Sharing(SharingStrategy.MPS, mps=MpsConfig(50, "1Gi", (("0", "2Gi"),)))),
    ],
)
def test_a_prepared_config_survives_the_checkpoint(config: GpuConfig | MigDeviceConfig) -> None:
    """Found by the round-trip property: a MIG device with ``strategy: TimeSlicing`` was
    written to the checkpoint with a ``timeSlicingConfig`` that MigDeviceConfig does not
    have, so the next start found the checkpoint invalid and forgot every prepared claim."""
    mig = isinstance(config, MigDeviceConfig)
    device = PreparedDevice(
        requests=("gpu",),
        pool="node-a",
        device="gpu-0-mig-1" if mig else "gpu-0",
        cdi_device_ids=("k8s.gpu.nvidia.com/claim=x",),
        kind="mig" if mig else "gpu",
        uuid="MIG-1" if mig else "GPU-1",
        gpu_minor=0,
        config=config,
        mig=MigInstance("GPU-1", 1, 0, 510, 12, 13) if mig else None,
    )
    claim = PreparedClaim(
        uid="6ba7b814-9dad-11d1-80b4-00c04fd430c8",
        namespace="default",
        name="c",
        state=ClaimState.PREPARE_COMPLETED,
        devices=(device,),
    )
    checkpoint = Checkpoint("boot-1", {claim.uid: claim})
    assert from_dict(json.loads(encode(checkpoint))) == checkpoint


# -- the whole ResourceClaim, as the API server could return it ----------------------------

PLAN_DEVICES = node_devices(h100_mixed_mig_node())
PLAN_REF = ClaimRef("ns", "0f1e2d3c-4b5a-4697-8877-665544332211", "claim")


@st.composite
def claim_documents(draw: st.DrawFn) -> Any:
    """A ResourceClaim allocated on this node (GPU and MIG results, configs), then mutated:
    any part replaced by random JSON, dropped or wrapped in a list."""
    results = [
        {"request": r, "driver": DRIVER, "pool": "node-1", "device": d}
        for r, d in draw(
            st.lists(
                st.tuples(
                    st.sampled_from(["gpu", "a/b", "mig"]),
                    st.sampled_from([*sorted(PLAN_DEVICES), "gpu-9"]),
                ),
                max_size=3,
            )
        )
    ]
    configs = [
        {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": p}}
        for p in draw(st.lists(valid_gpu_configs, max_size=2))
    ]
    document = {
        "metadata": {"uid": PLAN_REF.uid, "namespace": "ns", "name": "claim"},
        "status": {"allocation": {"devices": {"results": results, "config": configs}}},
    }
    # the reader (kube/claims.py) refuses a document that is not an object before planning
    return draw(mutated(st.just(document)).filter(lambda d: isinstance(d, dict)))


@fuzz_settings(ci_examples=300)
@given(claim_documents(), st.booleans())
@example({"metadata": [], "status": {}}, False)
@example({"metadata": {"uid": PLAN_REF.uid}, "status": ["allocation"]}, True)
@example({"metadata": {"uid": PLAN_REF.uid}, "status": {"allocation": {"devices": []}}}, False)
def test_claim_planning_is_precise(document: Any, sharing: bool) -> None:
    """``plan_claim`` on any claim document: a plan, or PrepareRefused naming the claim
    (a per-claim error); any other exception would fail the whole request as INTERNAL."""
    try:
        planned = plan_claim(
            PLAN_REF, document, driver=DRIVER, pool="node-1", devices=PLAN_DEVICES, sharing=sharing
        )
    except PrepareRefused as refused:
        assert "ns/claim" in str(refused) or PLAN_REF.uid in str(refused), refused
    else:
        assert all(p.device.name in PLAN_DEVICES for p in planned.devices)
