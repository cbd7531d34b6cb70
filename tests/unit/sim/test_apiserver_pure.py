"""The pure parts of the embedded API server: selectors, patches, store history, the request
policies of ResourceSlices."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.sim.apiserver import ApiError, KindRegistry
from agent.sim.apiserver.patch import apply_patch, json_patch, merge_patch
from agent.sim.apiserver.selectors import Selector, parse_label_selector
from agent.sim.apiserver.store import ObjectStore
from tests.support import k8s_schema
from tests.unit.sim.conftest import slice_body

KINDS = KindRegistry()
SLICE = KINDS.resolve("resourceslices")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=10,
)
json_objects = st.dictionaries(st.text(max_size=3), json_values, max_size=4)


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ("", {}, True),
        ("a=1", {"a": "1"}, True),
        ("a=1", {"a": "2"}, False),
        ("a!=1", {}, True),
        ("a in (1, 2),b", {"a": "2", "b": ""}, True),
        ("a notin (1,2)", {"a": "1"}, False),
        ("!a", {"a": "1"}, False),
        ("x.io/a == v", {"x.io/a": "v"}, True),
    ],
)
def test_label_selector(selector: str, labels: dict[str, str], expected: bool) -> None:
    assert all(r.matches(labels) for r in parse_label_selector(selector)) is expected


@pytest.mark.parametrize("bad", ["a in 1", "a=(", "=x", "a b"])
def test_label_selector_rejects_garbage(bad: str) -> None:
    with pytest.raises(ApiError) as error:
        parse_label_selector(bad)
    assert error.value.code == 400


def test_field_selector_absent_field_is_empty_string() -> None:
    body = slice_body()
    del body["spec"]["nodeName"]
    assert Selector.from_query(SLICE, None, "spec.nodeName=", "").matches(body)
    assert not Selector.from_query(SLICE, None, "spec.nodeName!=", "").matches(body)


@given(json_objects, json_objects)
def test_merge_patch_sets_and_deletes_top_level_keys(
    target: dict[str, Any], patch: dict[str, Any]
) -> None:
    result = merge_patch(target, patch)
    for key, value in patch.items():
        if value is None:
            assert key not in result
        elif not isinstance(value, dict):
            assert result[key] == value
    for key in target.keys() - patch.keys():
        assert result[key] == target[key]


@given(json_objects)
def test_merge_patch_with_itself_minus_nulls_is_identity(doc: dict[str, Any]) -> None:
    cleaned = merge_patch({}, doc)
    assert merge_patch(cleaned, cleaned) == cleaned


def test_json_patch_is_atomic_and_escapes_pointers() -> None:
    doc = {"a/b": {"~c": 1}, "list": [1, 2]}
    assert json_patch(doc, [{"op": "replace", "path": "/a~1b/~0c", "value": 2}]) == {
        "a/b": {"~c": 2}, "list": [1, 2],
    }  # fmt: skip
    ops = [{"op": "remove", "path": "/list/0"}, {"op": "remove", "path": "/missing"}]
    with pytest.raises(ApiError):
        json_patch(doc, ops)
    assert doc["list"] == [1, 2]
    moved = json_patch(doc, [{"op": "move", "from": "/list/1", "path": "/list/0"},
                             {"op": "copy", "from": "/list", "path": "/copy"}])  # fmt: skip
    assert moved["list"] == [2, 1] and moved["copy"] == [2, 1]


def test_unknown_patch_type_is_415() -> None:
    with pytest.raises(ApiError) as error:
        apply_patch("application/apply-patch+yaml", {}, {})
    assert error.value.code == 415


def test_history_window_and_global_resource_version() -> None:
    store = ObjectStore(KINDS, history_size=2)
    nodes = KINDS.resolve("nodes")
    first = store.put(nodes, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n"}})
    slice_ = store.put(SLICE, slice_body(name="s"))
    assert (
        int(slice_["metadata"]["resourceVersion"]) == int(first["metadata"]["resourceVersion"]) + 1
    )
    assert [e.rv for e in store.events_after(1)] == [2, 3]
    store.delete(SLICE, None, "s")
    with pytest.raises(ApiError) as gone:
        store.events_after(1)
    assert gone.value.code == 410
    assert [e.type for e in store.events_after(2)] == ["ADDED", "DELETED"]


def policy_body(value: str, policy: dict[str, Any], shared: bool = True) -> dict[str, Any]:
    body = slice_body(name="s")
    device = body["spec"]["devices"][0]
    device["capacity"] = {"c": {"value": value, "requestPolicy": policy}}
    if shared:
        device["allowMultipleAllocations"] = True
    return body


def ranged(
    default: str, low: str, high: str | None = None, step: str | None = None
) -> dict[str, Any]:
    bounds = {"min": low} | ({} if high is None else {"max": high})
    return {"default": default, "validRange": bounds | ({} if step is None else {"step": step})}


@pytest.mark.parametrize(
    ("value", "policy", "shared", "message"),
    [
        ("8", ranged("2", "0", "8", "2"), True, None),
        ("1", ranged("1", "1", "1"), True, None),  # one amount, no step
        ("8", {"default": "2", "validValues": ["2", "8"]}, True, None),
        ("8", ranged("2", "0", "8", "2"), False, "Forbidden: allowMultipleAllocations must be"),
        ("0", ranged("0", "0", "0", "1"), True, 'step: Invalid value: "1": one step 1 is larger'),
        ("1", ranged("1", "1", "1", "1"), True, "one step 2 is larger than capacity value: 1"),
        ("8", ranged("0", "1", "8"), True, "default is less than min: 1"),
        ("8", ranged("8", "0", "4"), True, "default is more than max: 4"),
        ("8", ranged("9", "9"), True, "min is larger than capacity value: 8"),
        ("8", ranged("0", "0", "9"), True, "max is larger than capacity value: 8"),
        ("8", ranged("3", "1", "7", "3"), True, '"3": value is not a multiple of a given step'),
        ("8", ranged("4", "1", "8", "3"), True, '"8": value is not a multiple of a given step'),
        ("8", {"default": "2", "validValues": ["2", "9"]}, True, "option is larger than capacity"),
        ("8", {"default": "3", "validValues": ["2", "4"]}, True, "default value is not valid"),
        ("8", {"default": "2", "validValues": ["4", "2"]}, True, "sorted in ascending order"),
        ("8", {"default": "2", "validValues": ["2", "2"]}, True, 'Duplicate value: "2"'),
        ("8", {"validRange": {"min": "0"}}, True, "default: Required value"),
        ("8", {"default": "0", "validRange": {}}, True, "min: Required value"),
    ],
)
def test_request_policies_as_kube_apiserver_checks_them(
    value: str, policy: dict[str, Any], shared: bool, message: str | None
) -> None:
    """The embedded server refuses (422) the request policies kube-apiserver refuses, and
    agrees with the rules the slice tests check (``k8s_schema.request_policy_errors``)."""
    body = policy_body(value, policy, shared)
    store = ObjectStore(KINDS)
    if message is None:
        store.put(SLICE, body)
        assert k8s_schema.request_policy_errors([body]) == []
        return
    with pytest.raises(ApiError) as error:
        store.put(SLICE, body)
    assert error.value.code == 422
    assert error.value.message.startswith('ResourceSlice "s" is invalid: spec.devices[0].')
    assert "capacity[c].requestPolicy" in error.value.message and message in error.value.message
    assert k8s_schema.request_policy_errors([body])


def test_every_policy_error_is_listed() -> None:
    body = policy_body("0", ranged("1", "1", "2", "1"))
    with pytest.raises(ApiError) as error:
        ObjectStore(KINDS).put(SLICE, body)
    listed = error.value.message.removeprefix('ResourceSlice "s" is invalid: ')
    assert listed.startswith("[") and listed.endswith("]")
    assert listed.count("spec.devices[0].capacity[c].requestPolicy.validRange") == 3


@pytest.mark.parametrize(
    "policy",
    [{"default": "0", "validRange": "0"}, {"default": "0", "validValues": "0"}],
)
def test_a_malformed_policy_is_refused(policy: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as error:
        ObjectStore(KINDS).put(SLICE, policy_body("8", policy))
    assert error.value.code == 422 and "validRange an object" in error.value.message
