"""The pure write plan: matching, generations, deletes, and that one plan always suffices."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.dra import DeviceTaint, DraDevice, build_slices
from agent.kube.sliceplan import SlicePlan, canonical, plan_pool

NODE, DRIVER, UID = "node-a", "gpu.nvidia.com", "node-uid-1"
_names = itertools.count()


def devices(count: int, tainted: int = 0) -> list[DraDevice]:
    taint = DeviceTaint("gpu.nvidia.com/xid", "48")
    return [DraDevice(f"gpu-{i}", taints=(taint,) if i < tainted else ()) for i in range(count)]


def desired(count: int, tainted: int = 0) -> list[dict[str, Any]]:
    return build_slices(devices(count, tainted), node_name=NODE, driver_name=DRIVER, node_uid=UID)


def stored(objects: list[dict[str, Any]], generation: int) -> dict[str, dict[str, Any]]:
    """What the server would hold after creating ``objects`` at ``generation``."""
    out = {}
    for obj in objects:
        copied = copy.deepcopy(obj)
        # as the API server names it: the generateName (the slice's index first), then 5
        name = copied["metadata"].get("generateName", "slice-") + f"{next(_names):05d}"
        copied["metadata"] = {
            **copied["metadata"],
            "name": name,
            "uid": name,
            "resourceVersion": "1",
        }
        copied["spec"]["pool"]["generation"] = generation
        out[name] = copied
    return out


def apply(observed: dict[str, dict[str, Any]], plan: SlicePlan) -> dict[str, dict[str, Any]]:
    state = copy.deepcopy(observed)
    for obj in plan.deletes:
        del state[obj["metadata"]["name"]]
    for body, have in plan.updates:
        assert body["metadata"]["name"] == have["metadata"]["name"]
        state[body["metadata"]["name"]] = copy.deepcopy(body)
    for body in plan.creates:
        state.update(stored([body], plan.generation))
    return state


def plan(want: list[dict[str, Any]], have: dict[str, dict[str, Any]], **kw: Any) -> SlicePlan:
    return plan_pool(want, have, pool_name=NODE, **kw)


def test_first_publish_creates_every_slice_at_generation_1() -> None:
    result = plan(desired(200), {})
    assert (result.generation, len(result.creates), result.deletes, result.updates) == (
        1,
        2,
        [],
        [],
    )
    assert {obj["spec"]["pool"]["generation"] for obj in result.creates} == {1}


def test_published_pool_needs_nothing() -> None:
    assert plan(desired(200), stored(desired(200), 4)).empty


def test_one_lost_slice_is_recreated_at_the_same_generation() -> None:
    have = stored(desired(200), 4)
    del have[sorted(have)[0]]
    result = plan(desired(200), have)
    assert (result.generation, len(result.creates), result.updates, result.deletes) == (
        4,
        1,
        [],
        [],
    )


def test_one_edited_slice_is_updated_in_place_two_bump_the_generation() -> None:
    have = stored(desired(200), 4)
    first, second = sorted(have)
    have[first]["spec"]["devices"][0]["attributes"] = {"edited": {"bool": True}}
    one = plan(desired(200), have)
    assert (one.generation, len(one.updates), one.creates, one.deletes) == (4, 1, [], [])
    have[second]["spec"]["devices"][0]["attributes"] = {"edited": {"bool": True}}
    both = plan(desired(200), have)
    assert (both.generation, len(both.updates)) == (5, 2)


def test_taint_that_reshapes_the_slices_bumps_the_generation() -> None:
    have = stored(desired(256), 2)
    want = build_slices(
        [d.with_taints((DeviceTaint("k"),)) if d.name == "gpu-200" else d for d in devices(256)],
        node_name=NODE,
        driver_name=DRIVER,
        node_uid=UID,
    )
    # the tainted device's run of 128 is cut in two 64s: the set of slices changes -> bump
    result = plan(want, have)
    assert result.generation == 3 and len(result.creates) == 1 and len(result.updates) == 2


def test_growing_and_shrinking_bump_and_rewrite_everything() -> None:
    grown = plan(desired(200), stored(desired(100), 3))
    assert grown.generation == 4 and len(grown.updates) == 1 and len(grown.creates) == 1
    shrunk = plan(desired(100), stored(desired(200), 3))
    assert shrunk.generation == 4 and len(shrunk.deletes) == 1 and len(shrunk.updates) == 1


def test_duplicates_stale_generations_and_foreign_pools_are_deleted() -> None:
    have = stored(desired(10), 3)
    have.update(stored(desired(10), 3))  # a duplicate
    have.update(stored(desired(10), 1))  # a stale generation
    foreign = stored(desired(10), 3)
    for obj in foreign.values():
        obj["spec"]["pool"]["name"] = "old-pool"
    have.update(foreign)
    result = plan(desired(10), have)
    assert len(result.deletes) == 3 and result.creates == []
    final = apply(have, result)
    assert len(final) == 1 and plan(desired(10), final).empty


def test_an_interrupted_rewrite_is_finished_without_deletes() -> None:
    """A pass moved one of two slices to generation 5 and failed before the other."""
    have = stored(desired(200)[:1], 5)
    have.update(stored(desired(200)[1:], 4))
    result = plan(desired(200), have)
    assert (result.generation, len(result.updates), result.creates, result.deletes) == (
        5,
        1,
        [],
        [],
    )
    assert plan(desired(200), apply(have, result)).empty


def test_missing_owner_reference_is_added() -> None:
    have = stored(desired(4), 1)
    for obj in have.values():
        del obj["metadata"]["ownerReferences"]
    (update,) = plan(desired(4), have).updates
    assert update[0]["metadata"]["ownerReferences"][0]["uid"] == UID


def test_owner_of_a_recreated_node_replaces_the_old_one() -> None:
    """A Node registered again has a new uid: the reference to the old Node goes (two
    controller references are invalid), other owners stay."""
    other = {"apiVersion": "example.com/v1", "kind": "Keeper", "name": "k", "uid": "keeper-1"}
    have = stored(desired(200), 1)  # two slices
    for obj in have.values():
        [ref] = obj["metadata"]["ownerReferences"]
        obj["metadata"]["ownerReferences"] = [{**ref, "uid": "node-uid-0"}, other]
    result = plan(desired(200), have)
    assert len(result.updates) == 2 and not result.creates and not result.deletes
    for body, _ in result.updates:
        assert body["metadata"]["ownerReferences"] == [
            other,
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": UID, "controller": True},
        ]
    assert plan(desired(200), apply(have, result)).empty


def test_generation_never_goes_below_what_was_published() -> None:
    assert plan(desired(4), {}, generation_floor=7).generation == 8
    assert plan(desired(4), stored(desired(4), 3), generation_floor=7).generation == 8


def test_accepted_server_version_counts_as_a_match() -> None:
    want = desired(4, tainted=4)
    have = stored(want, 1)
    for obj in have.values():
        for device in obj["spec"]["devices"]:
            device.pop("taints")
    assert not plan(want, have).empty
    (name,) = have
    target = copy.deepcopy(want[0])
    target["spec"]["pool"]["generation"] = 1
    accepted = {name: (canonical(target["spec"]), canonical(have[name]["spec"]))}
    assert plan(want, have, accepted=accepted).empty


@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, 300),
    st.integers(0, 300),
    st.integers(0, 5),
    st.lists(st.sampled_from(["drop", "dup", "stale", "edit"]), max_size=4),
    st.integers(0, 20),
)
def test_one_plan_always_reaches_the_desired_pool(
    before: int, after: int, generation: int, damage: list[str], floor: int
) -> None:
    have = stored(desired(before), generation)
    for index, what in enumerate(damage):
        names = sorted(have)
        if not names:
            break
        victim = have[names[index % len(names)]]
        if what == "drop":
            del have[victim["metadata"]["name"]]
        elif what == "dup":
            have.update(stored([victim], generation))
        elif what == "stale":
            have.update(stored([victim], max(0, generation - 1)))
        else:
            victim["spec"]["devices"] = victim["spec"]["devices"][:-1]
    want = desired(after)
    result = plan(want, have, generation_floor=floor)
    final = apply(have, result)
    assert plan(want, final, generation_floor=max(floor, result.generation)).empty
    assert {obj["spec"]["pool"]["generation"] for obj in final.values()} == {result.generation}
    assert {obj["spec"]["pool"]["resourceSliceCount"] for obj in final.values()} == {len(want)}
    names = sorted(
        name for obj in final.values() for name in (d["name"] for d in obj["spec"]["devices"])
    )
    assert names == sorted(d.name for d in devices(after))
    assert result.generation >= floor


def test_slices_named_otherwise_are_replaced_once() -> None:
    """Slice names carry the slice's index (1.36 sorts slices by name): slices an earlier
    version created with random names, or with another slice's index, are replaced by a
    rewrite at a new generation, once; then the pool needs nothing."""
    legacy = {}
    for index, obj in enumerate(stored(desired(200), 4).values()):
        name = f"{NODE}-{DRIVER}-old{index}"
        legacy[name] = {**obj, "metadata": {**obj["metadata"], "name": name, "uid": name}}
    result = plan(desired(200), legacy)
    assert result.generation == 5
    assert sorted(o["metadata"]["name"] for o in result.deletes) == sorted(legacy)
    assert len(result.creates) == 2 and result.updates == []
    after = apply(legacy, result)
    assert plan(desired(200), after).empty
    names = sorted(after)
    assert [after[n]["spec"]["devices"][0]["name"] for n in names] == ["gpu-0", "gpu-128"]

    swapped = stored(desired(200), 4)
    first, second = sorted(swapped)
    swapped[first]["spec"], swapped[second]["spec"] = (
        swapped[second]["spec"],
        swapped[first]["spec"],
    )
    result = plan(desired(200), swapped)  # each name keeps its index: rewritten in place
    assert (len(result.updates), result.creates, result.deletes) == (2, [], [])
    assert plan(desired(200), apply(swapped, result)).empty
