"""The packing simulator: models never over-allocate, runs are deterministic, the JSON output
follows its schema, and the packing order's promises on an empty DGX H100."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest

from agent.dra.names import parse_mig_device_name
from agent.dra.order import gpu_minor
from agent.sim.packing import cli
from agent.sim.packing.cluster import NodeTemplate, load_template, node_names
from agent.sim.packing.models import ALL_BALANCED_H100, Dra, Model, Placement, build_models
from agent.sim.packing.replay import Capacity, replay
from agent.sim.packing.workload import PodRequest, seed_workload, write_openb

pytestmark = pytest.mark.anyio
DGX = Capacity(224_000, 2048 * 1024)


@pytest.fixture(scope="module")
def template() -> NodeTemplate:
    return anyio.run(load_template, "dgx-h100")


def pod(name: str, *, gpus: int = 0, milli: int = 1000, profile: str | None = None) -> PodRequest:
    return PodRequest(name, 0.0, None, 1000, 1024, gpus, milli, profile, "none")


class Checked:
    """A model whose every placement and release is checked against the GPUs' capacity:
    a whole GPU alone, MIG instances within the GPU's compute and memory slices, none of
    them overlapping."""

    def __init__(self, inner: Model, template: NodeTemplate) -> None:
        self.inner, self.name = inner, inner.name
        self.sizes = {size.profile: size for size in template.sizes}
        self.held: dict[tuple[int, int], list[tuple[str, Placement]]] = defaultdict(list)
        self.steps = 0

    def try_node(self, node: int, pod: PodRequest) -> Placement | None:
        return self.inner.try_node(node, pod)

    def commit(self, placement: Placement) -> None:
        self.inner.commit(placement)
        for minor, what in self._parts(placement):
            self.held[(placement.node, minor)].append((what, placement))
        self._check()

    def release(self, placement: Placement) -> None:
        self.inner.release(placement)
        for key, items in self.held.items():
            self.held[key] = [(w, p) for w, p in items if p is not placement]
        self._check()

    def _parts(self, placement: Placement) -> list[tuple[int, str]]:
        token = placement.token
        if isinstance(token, dict):  # DRA: the allocated devices
            results = token["status"]["allocation"]["devices"]["results"]
            out = []
            for result in results:
                parsed = parse_mig_device_name(result["device"])
                minor = parsed[0] if parsed else gpu_minor(result["device"])
                assert minor is not None
                out.append((minor, result["device"]))
            return out
        if self.name == "device-plugin":
            return [(minor, f"gpu-{minor}") for minor in placement.gpus]
        return [(placement.gpus[0], f"instance-{token}")]  # static MIG: one instance

    def _check(self) -> None:
        self.steps += 1
        for (_, minor), items in self.held.items():
            names = [what for what, _ in items]
            assert len(names) == len(set(names)), f"a device given twice: {names}"
            if any(name == f"gpu-{minor}" for name in names):
                assert len(names) == 1, f"a whole GPU shared: {names}"
            slices: set[int] = set()
            compute = Fraction(0)
            for name in names:
                parsed = parse_mig_device_name(name)
                if parsed is None:
                    continue
                size = next(s for s in self.sizes.values() if _rfc(s.profile) == parsed[1])
                taken = set(range(parsed[3], parsed[3] + size.memory_slices))
                assert not slices & taken, f"MIG instances overlap on GPU {minor}: {names}"
                slices |= taken
                compute += Fraction(size.compute_slices, size.total_compute)
            assert compute <= 1, f"GPU {minor} over-allocated: {names}"


def _rfc(profile: str) -> str:
    return profile.replace(".", "").replace("+", "-").lower()


async def test_no_model_ever_over_allocates_a_gpu(template: NodeTemplate) -> None:
    pods = seed_workload(capacity_gpus=24, load=3.0, seed=7, sizes=template.sizes)
    pods = [replace(p, lifetime=(p.lifetime or 0) * 4) for p in pods]  # overlap, then leave
    names = node_names(3)
    for scoring in ("least-allocated", "most-allocated"):
        for model in build_models(cli.MODEL_NAMES, template, names, ALL_BALANCED_H100):
            checked = Checked(model, template)
            result = replay(
                checked,
                pods,
                template=template,
                nodes=3,
                node=DGX,
                scoring=scoring,
                seed=3,
                departures=True,
                latency_samples=0,
            )
            assert checked.steps > result.placed  # every commit and some releases checked
            assert 0 < result.placed <= result.arrived == len(pods)
            assert 0 <= result.allocation_rate <= 1 and 0 <= result.unusable <= 1


async def test_the_packing_order_keeps_a_large_placement_free(template: NodeTemplate) -> None:
    """After one 1g.10gb claim on an empty DGX H100, a 4g.40gb still fits on that GPU in the
    packing order (in the names order only a 3g.40gb does); seven 1g claims land on one GPU."""
    one_g = pod("small", milli=100, profile="1g.10gb")
    four_g = pod("large", milli=550, profile="4g.40gb")
    three_g = pod("middle", milli=400, profile="3g.40gb")

    def first_then(order: str, second: PodRequest) -> tuple[Placement, Placement]:
        model = Dra(template, ["n0"], "packing" if order == "packing" else "names")
        first = model.try_node(0, one_g)
        assert first is not None
        model.commit(first)
        then = model.try_node(0, second)
        assert then is not None
        return first, then

    first, large = first_then("packing", four_g)
    assert large.gpus == first.gpus == (0,)
    first, large = first_then("names", four_g)
    assert first.gpus == (0,) and large.gpus == (1,)  # slice 0 taken: 4g@0 blocked
    first, middle = first_then("names", three_g)
    assert middle.gpus == first.gpus

    for order in ("packing", "names"):
        model = Dra(template, ["n0"], "packing" if order == "packing" else "names")
        gpus = set()
        for index in range(7):
            placement = model.try_node(0, replace(one_g, name=f"s{index}"))
            assert placement is not None
            model.commit(placement)
            gpus.update(placement.gpus)
        assert gpus == {0}, order


def _args(**overrides: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    words = ["--nodes", "3", "--load", "1.2", "--latency-samples", "4", "-o", "json"]
    for key, value in overrides.items():
        words += [f"--{key.replace('_', '-')}", str(value)]
    return parser.parse_args(words)


async def _json(capsys: pytest.CaptureFixture[str], **overrides: Any) -> dict[str, Any]:
    assert await cli.run(_args(**overrides)) == 0
    document: dict[str, Any] = json.loads(capsys.readouterr().out)
    return document


def _without_timing(document: dict[str, Any]) -> dict[str, Any]:
    stable = {**document, "seconds": 0}
    stable["results"] = [
        {**r, "seconds": 0, "allocationLatencyMs": {**r["allocationLatencyMs"], "p50": 0, "p99": 0}}
        for r in document["results"]
    ]
    return stable


async def test_a_seeded_run_is_deterministic_and_follows_its_schema(
    capsys: pytest.CaptureFixture[str],
) -> None:
    first = await _json(capsys, seed=5)
    jsonschema.validate(first, cli.schema())
    assert {(r["model"], r["nodeScoring"]) for r in first["results"]} == {
        (m, s) for m in cli.MODEL_NAMES for s in ("least-allocated", "most-allocated")
    }
    again = await _json(capsys, seed=5)
    assert _without_timing(again) == _without_timing(first)
    other = await _json(capsys, seed=6)
    assert _without_timing(other) != _without_timing(first)
    # the table says the same, for people
    assert await cli.run(_args(seed=5, output="table")) == 0
    table = capsys.readouterr().out
    assert "dra-name-order" in table and "stranded@1st" in table


async def test_an_openb_trace_is_replayed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "openb_pod_list_small.csv"
    pods = [
        PodRequest(
            f"p{i}",
            float(i),
            100.0,
            4000,
            8192,
            1 if i % 3 else 0,
            1000 if i % 3 else 300,
            None if i % 3 else "3g.40gb",
            "none",
        )
        for i in range(40)
    ]
    write_openb(trace, pods)
    document = await _json(capsys, workload=f"openb:{trace}", departures="on")
    jsonschema.validate(document, cli.schema())
    assert document["workload"]["source"] == f"openb:{trace}"
    dra = next(r for r in document["results"] if r["model"] == "dra")
    assert 30 <= dra["arrived"] <= 40 and dra["placed"] > 0  # until 1.2 x 24 GPUs arrived
    broken = tmp_path / "broken.csv"
    broken.write_text(trace.read_text().replace("\np3,", "\np3,x", 1))
    with pytest.raises(Exception, match=r"broken.csv:5: "):
        await cli.run(_args(workload=f"openb:{broken}"))


async def test_a_profile_without_mig_places_fractions_on_whole_gpus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert await cli.run(_args(profile="l40s-pcie")) == 0
    captured = capsys.readouterr()
    assert "no MIG-capable GPU" in captured.err
    document = json.loads(captured.out)
    models = {r["model"] for r in document["results"]}
    assert models == {"device-plugin", "dra-name-order", "dra"}
    dra = next(r for r in document["results"] if r["model"] == "dra")
    assert dra["placed"] > 0 and dra["internalWaste"] > 0  # fractions rounded up to a GPU
