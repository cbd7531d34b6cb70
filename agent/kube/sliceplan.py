"""What to write so that the API server holds the desired slices: a pure decision.

Given the slices this node should publish and the ones the API server holds, :func:`plan_pool`
says which to delete, update and create, and at which pool generation. Keeping it free of
I/O lets the generation rules be tested case by case.

The rules follow the Go ``resourceslice`` controller (kubelet-dra-protocol.md §6): only the
highest generation counts, obsolete slices go first, matching is by device-name set (and counter-set names), and a
change that touches more than one slice, or the set of slices, moves the pool to a new
generation with every slice rewritten. Two refinements save writes where the Go controller
spends them without need:

* a slice that disappeared (the kubelet's wipe, a stray ``kubectl delete``) is recreated at
  the *current* generation when nothing else changes and the slice count stays right: the
  pool at that generation ends up exactly as it was, so consumers can never mix contents,
  and a repaired wipe costs one write per slice instead of a rewrite of the survivors;
* leftover slices are paired with leftover desired ones in order and updated, instead of
  deleted and created again;
* slices an interrupted rewrite left at an older generation are rewritten at the current
  one, not deleted and created again.

A slice is only ever paired with a desired one whose ``generateName`` its name starts with:
the name carries the slice's place in the pool (1.36 sorts slices by name), so slices named
otherwise (random names before the index prefix, an index now wrong) are replaced once.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.dra.slices import content_names, slices_match

Obj = dict[str, Any]
#: kube-apiserver cuts a longer ``generateName`` to this many characters (then adds 5).
MAX_GENERATED_PREFIX = 58


@dataclass
class SlicePlan:
    """The writes of one reconcile pass, in the order they must happen."""

    generation: int
    deletes: list[Obj] = field(default_factory=list)
    #: (object to PUT, the observed object it replaces)
    updates: list[tuple[Obj, Obj]] = field(default_factory=list)
    creates: list[Obj] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.deletes or self.updates or self.creates)


def canonical(spec: Any) -> str:
    """A stable text form of a spec, to remember exactly what was written or stored."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str)


def pool_of(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return ((obj.get("spec") or {}).get("pool")) or {}


def generation_of(obj: Mapping[str, Any]) -> int:
    try:
        return int(pool_of(obj).get("generation") or 0)
    except (TypeError, ValueError):
        return 0


def plan_pool(
    desired: Sequence[Obj],
    observed: Mapping[str, Obj],
    *,
    pool_name: str,
    generation_floor: int = 0,
    accepted: Mapping[str, tuple[str, str]] | None = None,
) -> SlicePlan:
    """The writes that turn ``observed`` (name -> slice) into ``desired``.

    ``desired`` comes from :func:`agent.dra.slices.build_slices` (its generation is
    ignored). ``generation_floor`` is the highest generation this process has published, so a
    pool recreated after a wipe never goes back in generation. ``accepted`` maps a slice name
    to (what we wrote, what the server stored) for slices whose fields the server dropped:
    that pair counts as a match, so a disabled feature gate does not cause a write loop.
    """
    accepted = accepted or {}
    ours = [obj for obj in observed.values() if pool_of(obj).get("name") == pool_name]
    deletes = sorted(
        (obj for obj in observed.values() if pool_of(obj).get("name") != pool_name), key=_name
    )
    current = max((generation_of(obj) for obj in ours), default=None)
    live = sorted((obj for obj in ours if generation_of(obj) == current), key=_name)
    stale = sorted((obj for obj in ours if generation_of(obj) != current), key=_name)

    # Live slices first; then older ones, left over by an interrupted rewrite, are rewritten
    # rather than deleted and created again.
    pairs, leftover_desired, leftover_live = _match(desired, live, current or 0, accepted)
    older, leftover_desired, leftover_stale = _match(
        leftover_desired, stale, current or 0, accepted
    )
    pairs.extend(older)
    leftover_observed = leftover_live + leftover_stale
    creates: list[Obj] = []
    for want in leftover_desired:
        have = next((obj for obj in leftover_observed if _named_for(want, obj)), None)
        if have is None:
            creates.append(want)
        else:
            leftover_observed.remove(have)
            pairs.append((want, have))
    extra = leftover_observed
    deletes.extend(extra)

    if current is not None and current >= generation_floor:
        changed = [(want, have) for want, have in pairs if not _same(want, have, current, accepted)]
        count_ok = all(
            pool_of(have).get("resourceSliceCount") == len(desired)
            for _, have in pairs
            if generation_of(have) == current
        )
        extra_live = any(generation_of(obj) == current for obj in extra)
        small = (not changed) or (len(changed) == 1 and not creates)
        if count_ok and not extra_live and small:
            return SlicePlan(
                current,
                deletes,
                [(_update_body(want, have, current), have) for want, have in changed],
                [_with_generation(want, current) for want in creates],
            )
    generation = max(current or 0, generation_floor) + 1
    updates = [
        (_update_body(want, have, generation), have)
        for want, have in pairs
        if not _same(want, have, generation, accepted)
    ]
    return SlicePlan(
        generation, deletes, updates, [_with_generation(want, generation) for want in creates]
    )


def _match(
    desired: Sequence[Obj],
    live: Sequence[Obj],
    generation: int,
    accepted: Mapping[str, tuple[str, str]],
) -> tuple[list[tuple[Obj, Obj]], list[Obj], list[Obj]]:
    """Pair desired and live slices with the same device names; among duplicates prefer
    the one already right, then the oldest name."""
    by_names: dict[frozenset[str], list[Obj]] = {}
    for obj in live:
        by_names.setdefault(content_names(obj), []).append(obj)
    pairs: list[tuple[Obj, Obj]] = []
    leftover_desired: list[Obj] = []
    for want in desired:
        candidates = [c for c in by_names.get(content_names(want)) or [] if _named_for(want, c)]
        if not candidates:
            leftover_desired.append(want)
            continue
        best = next((c for c in candidates if _same(want, c, generation, accepted)), candidates[0])
        by_names[content_names(want)].remove(best)
        pairs.append((want, best))
    leftover_observed = sorted((obj for rest in by_names.values() for obj in rest), key=_sort_key)
    return pairs, leftover_desired, leftover_observed


def _named_for(want: Obj, have: Obj) -> bool:
    """Whether ``have``'s name is one ``want`` could have been created with: it starts with
    ``want``'s ``generateName`` (as the API server cuts it). Slice names carry the slice's
    index, which orders the pool's slices on 1.36 (:func:`agent.dra.slices.slice_name_prefix`),
    and a name cannot be changed: a slice named for another place is replaced."""
    prefix = (want.get("metadata") or {}).get("generateName")
    return not prefix or _name(have).startswith(prefix[:MAX_GENERATED_PREFIX])


def _same(want: Obj, have: Obj, generation: int, accepted: Mapping[str, tuple[str, str]]) -> bool:
    if not _owned(want, have):
        return False
    target = _with_generation(want, generation)
    # The server echoes what it was sent, so equality is the common, cheap case; the
    # tolerant comparison (quantity spellings, defaulted fields) only runs when it fails.
    if target.get("spec") == have.get("spec") or slices_match(target, have):
        return True
    remembered = accepted.get(_name(have))
    return remembered == (canonical(target.get("spec")), canonical(have.get("spec")))


def _owned(want: Obj, have: Obj) -> bool:
    wanted = (want.get("metadata") or {}).get("ownerReferences") or []
    present = (have.get("metadata") or {}).get("ownerReferences") or []
    return all(any(ref.get("uid") == mine.get("uid") for ref in present) for mine in wanted)


def _with_generation(want: Obj, generation: int) -> Obj:
    """``want`` at ``generation``; shares the device list (nothing here mutates it)."""
    spec = want["spec"]
    return {**want, "spec": {**spec, "pool": {**spec["pool"], "generation": generation}}}


def _update_body(want: Obj, have: Obj, generation: int) -> Obj:
    target = _with_generation(want, generation)
    metadata = copy.deepcopy(have.get("metadata") or {})
    wanted = (want.get("metadata") or {}).get("ownerReferences") or []
    # A reference to an earlier object of the same name (a Node deleted and registered again)
    # is replaced, not kept: only one reference may be the controller, and the old one is gone.
    owners = [ref for ref in metadata.get("ownerReferences") or [] if not _stale(ref, wanted)]
    for mine in wanted:
        if not any(ref.get("uid") == mine.get("uid") for ref in owners):
            owners.append(mine)
    if owners:
        metadata["ownerReferences"] = owners
    return {
        "apiVersion": target["apiVersion"],
        "kind": target["kind"],
        "metadata": metadata,
        "spec": target["spec"],
    }


def _stale(ref: Mapping[str, Any], wanted: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``ref`` names an object we want as owner, but an earlier one (another uid)."""
    same = ("apiVersion", "kind", "name")
    return any(
        all(ref.get(k) == mine.get(k) for k in same) and ref.get("uid") != mine.get("uid")
        for mine in wanted
    )


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def _sort_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    names = sorted(content_names(obj))
    return (names[0] if names else "", _name(obj))
