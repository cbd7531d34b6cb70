"""NVLink domains and peer counts from per-GPU links (pure function)."""

from __future__ import annotations

import re

from agent.hardware.inventory import Gpu, NvLink
from agent.hardware.topology import assign_nvlink_domains, domain_id


def gpu(index: int, *remotes: str, active: bool = True) -> Gpu:
    links = tuple(NvLink(i, active, r, r.startswith("sw")) for i, r in enumerate(remotes))
    return Gpu(
        index=index, minor=index, uuid=f"GPU-{index}", name="x", brand="Nvidia",
        architecture="Hopper", cuda_compute_capability=(9, 0),
        pci_bus_id=f"0000:{index:02x}:00.0", nvlinks=links,
    )  # fmt: skip


def test_switch_connects_everyone() -> None:
    gpus = assign_nvlink_domains([gpu(i, "sw-a", "sw-b") for i in range(4)])
    assert len({g.nvlink_domain for g in gpus}) == 1
    assert {g.nvlink_peer_count for g in gpus} == {3}


def test_pairs_and_isolated_gpus() -> None:
    gpus = assign_nvlink_domains([
        gpu(0, "0000:01:00.0"), gpu(1, "0000:00:00.0"),
        gpu(2, "0000:03:00.0"), gpu(3, "0000:02:00.0"),
        gpu(4), gpu(5, "sw-a", active=False),
    ])  # fmt: skip
    assert gpus[0].nvlink_domain == gpus[1].nvlink_domain != gpus[2].nvlink_domain
    assert gpus[2].nvlink_domain == gpus[3].nvlink_domain
    assert [g.nvlink_peer_count for g in gpus] == [1, 1, 1, 1, 0, 0]
    assert gpus[4].nvlink_domain is None and gpus[5].nvlink_domain is None


def test_switches_chain_domains() -> None:
    gpus = assign_nvlink_domains([gpu(0, "sw-a"), gpu(1, "sw-b"), gpu(2, "sw-a", "sw-b")])
    assert len({g.nvlink_domain for g in gpus}) == 1


def test_domain_id_is_stable_and_a_dns_label() -> None:
    first = domain_id(["GPU-b", "GPU-a"])
    assert first == domain_id(["GPU-a", "GPU-b"])
    assert first != domain_id(["GPU-a", "GPU-c"])
    assert re.fullmatch(r"nvl-[0-9a-f]{12}", first) and len(first) <= 63
    gpus = assign_nvlink_domains([gpu(1, "sw"), gpu(0, "sw")])
    assert gpus[0].nvlink_domain == domain_id(["GPU-0", "GPU-1"])
