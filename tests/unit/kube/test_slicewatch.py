"""The slice cache: resourceVersions and tombstones keep it from going back in time."""

from __future__ import annotations

from agent.kube.slicewatch import SliceCache


def test_slice_cache_never_goes_back_in_time() -> None:
    cache = SliceCache()
    old = {"metadata": {"name": "a", "resourceVersion": "5"}, "spec": {"x": 1}}
    new = {"metadata": {"name": "a", "resourceVersion": "7"}, "spec": {"x": 2}}
    assert cache.apply("ADDED", new) and not cache.apply("MODIFIED", old)
    cache.forget("a", 7)
    assert not cache.apply("MODIFIED", new)  # a late event does not resurrect it
    assert cache.apply("ADDED", {"metadata": {"name": "a", "resourceVersion": "9"}})
    created = {"metadata": {"name": "b", "resourceVersion": "12"}}
    cache.apply("ADDED", created)
    cache.forget("a", 11)
    # A LIST served at version 10 knows neither the create at 12 nor the delete at 11.
    cache.replace_all([{"metadata": {"name": "a", "resourceVersion": "9"}}], 10)
    assert sorted(cache.snapshot()) == ["b"]
