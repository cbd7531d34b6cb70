"""``--binding-timeout``, the scheduler's PreBind bound, for the commands that schedule claims
(``sim allocate``, ``sim kubelet --pod``); a leaf, so that their ``--help`` stays light."""

from __future__ import annotations

import argparse

#: kube-scheduler's ``DynamicResourcesArgs.bindingTimeout`` default
DEFAULT_BINDING_TIMEOUT_S = 600.0


def add_binding_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--binding-timeout",
        type=float,
        default=DEFAULT_BINDING_TIMEOUT_S,
        metavar="SECONDS",
        help="how long the scheduler's PreBind waits for a device's binding conditions "
        "(KEP-5007, on from Kubernetes 1.36) to become True in the claim's status.devices, "
        "counted from status.allocation.allocationTimestamp, before it undoes the allocation "
        f"(kube-scheduler's bindingTimeout; default {DEFAULT_BINDING_TIMEOUT_S:g})",
    )
