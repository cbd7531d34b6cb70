"""How ``gpu-dra-agent explain`` prints its report for people (``-o table``).

By default a request shows the devices its DeviceClass admits, one line each with the verdict
and the first reason it is out (the claim holding it, a blocking taint, the counter sets it
would overdraw, the selector that refused it), then one line counting the rest by reason
("200 devices the class does not select"). With ``--all`` every device is listed with every
selector, taint and counter (the layout before the summary existed). A fitting claim then
gets a "first fit" line per allocated device: where the scheduler's walk meets it and what it
went past before it, since that order, not a score, is why the scheduler takes that device.
``-o json|yaml`` always carry everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

#: Widest line of the default table; longer text (a selector, a reason) is cut with "...".
MAX_WIDTH = 160


def _value(value: Any) -> str:
    return "(missing)" if value is None else str(value)


def _selectors(device: dict[str, Any]) -> str:
    parts = []
    for selector in device["selectors"]:
        verdict = {True: "yes", False: "no", None: "ERROR"}[selector["result"]]
        source = "class" if selector["source"].startswith("class") else "request"
        saw = ", ".join(
            f"{k.split('.')[-1] if k != 'driver' else k}={_value(v)}"
            for k, v in selector["saw"].items()
        )
        parts.append(
            f"{source}:{verdict}" + (f" ({saw})" if saw and selector["result"] is not True else "")
        )
    return "; ".join(parts)


def _details(device: dict[str, Any]) -> str:
    details = []
    for taint in device.get("taints", []):
        mark = (
            "blocks"
            if taint["blocks"]
            else "tolerated"
            if taint["effect"] != "None"
            else "harmless"
        )
        details.append(f"taint {taint['key']}={taint.get('value', '')}:{taint['effect']} ({mark})")
    if "allocatedTo" in device:
        details.append(f"allocated to {device['allocatedTo']}")
    for counter in device.get("counters", []):
        if counter["exhausted"]:
            details.append(
                f"counter {counter['counterSet']}/{counter['counter']}: needs {counter['needs']}, {counter['available']} left"
            )
    for capacity in device.get("capacity", []):  # a shared device (KEP-5075)
        consumes = capacity["consumes"] or "(breaks its request policy)"
        details.append(
            f"capacity {capacity['capacity']}: {capacity['remaining']} left, needs {consumes}"
        )
    if device.get("sharedBy"):
        details.append(f"shared by {', '.join(device['sharedBy'])}")
    if "problem" in device:
        details.append(device["problem"])
    for selector in device["selectors"]:
        if "error" in selector:
            error = selector["error"]
            details.append(
                f"{error['kind']} error at {error.get('line', '?')}:{error.get('column', '?')}: {error['message']}"
            )
    return "; ".join(details) or "-"


def render_table(report: dict[str, Any], *, all_devices: bool = False) -> str:
    """The report as text: by default the devices each request's class admits and a count of
    the rest; with ``all_devices`` every device with every selector, taint and counter."""
    clip = (lambda text: text) if all_devices else _clip
    verdict = "FITS" if report["fits"] else "DOES NOT FIT"
    lines = [f"claim {report['claim']} on node {report['node']}: {verdict}"]
    for request in report["requests"]:
        mode = (
            f"{request['count']} device(s)"
            if request["allocationMode"] == "ExactCount"
            else "all matching devices"
        )
        lines.append("")
        lines.append(
            f"request {request['name']}: {mode} of class {request['deviceClassName']}, {request['candidates']} candidate(s)"
        )
        for selector in request["selectors"]:
            lines.append(
                clip(f"  {selector['source']}: {' '.join(selector['expression'].split())}")
            )
        if "problem" in request:
            lines.append(clip(f"  {request['problem']}"))
        lines.extend(_every_device(request) if all_devices else _admitted_devices(request))
    for constraint in report["constraints"]:
        groups = (
            "; ".join(f"{g['value']}: {', '.join(g['devices'])}" for g in constraint["groups"])
            or "(no candidates)"
        )
        lines.append("")
        kind = "matchAttribute" if "matchAttribute" in constraint else "distinctAttribute"
        lines.append(
            clip(
                f"constraint {kind} {constraint[kind]} over {', '.join(constraint['requests'])}: {groups}"
            )
        )
    if report.get("firstFit"):
        lines.append("")
        lines.append("first fit:")
        lines.extend(clip(line) for line in _first_fit_lines(report["firstFit"]))
    lines.append("")
    if report["fits"] and all_devices:
        lines.append("allocation (status.allocation, as the scheduler would write it):")
        lines.extend(
            "  " + line
            for line in yaml.safe_dump(report["allocation"], sort_keys=False).splitlines()
        )
    elif report["fits"]:
        lines.append("allocation (-o yaml or --all: status.allocation as the scheduler writes it):")
        lines.extend(clip(line) for line in _allocation_lines(report["allocation"]))
    else:
        lines.append("why it does not fit:")
        lines.extend(clip(f"  - {reason}") for reason in report["reasons"])
    if report.get("binding"):
        lines.append("")
        lines.append("binding conditions (KEP-5007):")
        lines.extend(f"  {entry['text']}" for entry in report["binding"])
    return "\n".join(lines) + "\n"


def _columns(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Rows of cells, every column but the last padded to its widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in rows
    ]


def _every_device(request: dict[str, Any]) -> list[str]:
    rows = [("DEVICE", "VERDICT", "SELECTORS", "TAINTS / IN USE / COUNTERS")]
    rows += [(d["device"], d["verdict"], _selectors(d), _details(d)) for d in request["devices"]]
    return _columns(rows)


def admitted_by_class(device: dict[str, Any]) -> bool:
    """Every selector of the DeviceClass said yes (the request's own may still say no)."""
    return all(s["result"] is True for s in device["selectors"] if s["source"].startswith("class"))


def _admitted_devices(request: dict[str, Any]) -> list[str]:
    admitted = [d for d in request["devices"] if admitted_by_class(d)]
    rest: dict[str, int] = {}
    for device in request["devices"]:
        if not admitted_by_class(device):
            failed = next(s for s in device["selectors"] if s["result"] is not True)
            reason = (
                f"of other classes than {request['deviceClassName']}"
                if failed["result"] is False
                else "where the class's selector fails"
            )
            rest[reason] = rest.get(reason, 0) + 1
    lines = []
    if admitted:
        rows = [("DEVICE", "VERDICT", "WHY")]
        rows += [(d["device"], d["verdict"], _why(d)) for d in admitted]
        lines = [_clip(line) for line in _columns(rows)]
    else:
        lines = ["  (the class admits no device of this node)"]
    if rest:
        counts = ", ".join(f"{n} device(s) {reason}" for reason, n in rest.items())
        lines.append(_clip(f"  not shown: {counts} (--all lists every device)"))
    return lines


def _why(device: dict[str, Any]) -> str:
    """The first reason an admitted device is out, in a few words; of a shared device, what is
    left of it ("-": nothing to say)."""
    verdict = device["verdict"]
    if verdict == "selector error":
        error = next(s["error"] for s in device["selectors"] if "error" in s)
        return f"{error['kind']} error at {error.get('line', '?')}:{error.get('column', '?')}: {error['message']}"
    if verdict == "not selected":
        return _selectors(
            {"selectors": [s for s in device["selectors"] if s["result"] is not True]}
        )
    if verdict == "pool invalid":
        return str(device.get("problem", ""))
    if verdict == "tainted":
        return "; ".join(
            f"taint {t['key']}={t.get('value', '')}:{t['effect']}"
            for t in device.get("taints", [])
            if t["blocks"]
        )
    if verdict == "in use":
        return f"allocated to {device['allocatedTo']}"
    if verdict == "counters exhausted":
        return "; ".join(_counter_sets(device))
    # a shared device (KEP-5075), out for its capacity or not: what is left of it, who shares it
    phrases = [
        f"capacity {c['capacity']}: {c['remaining']} left, needs "
        f"{c['consumes'] or '(breaks its request policy)'}"
        for c in device.get("capacity", [])
    ]
    if device.get("sharedBy"):
        phrases.append(f"shared by {', '.join(device['sharedBy'])}")
    return "; ".join(phrases) or "-"


def _counter_sets(device: dict[str, Any]) -> list[str]:
    """One phrase per counter set the device would overdraw, however many counters it has."""
    exhausted: dict[str, list[dict[str, Any]]] = {}
    for counter in device.get("counters", []):
        if counter["exhausted"]:
            exhausted.setdefault(counter["counterSet"], []).append(counter)
    phrases = []
    for name, counters in exhausted.items():
        first = counters[0]
        more = f" and {len(counters) - 1} more" if len(counters) > 1 else ""
        phrases.append(
            f"counter set {name} exhausted: {first['counter']} needs {first['needs']}, "
            f"{first['available']} left{more}"
        )
    return phrases


def _first_fit_lines(entries: list[dict[str, Any]]) -> list[str]:
    """``  gpus: gpu-6  device 2 of 8, slice S position 2; before it: 1 in use``; the devices
    the request's selectors do not choose are left out of the count (-o json has them)."""
    lines = []
    for entry in entries:
        before = ", ".join(
            f"{n} {reason}" for reason, n in entry["before"].items() if reason != "not selected"
        )
        lines.append(
            f"  {entry['request']}: {entry['device']}  device {entry['order']} of {entry['of']}, "
            f"slice {entry['slice']} position {entry['inSlice']}; "
            f"before it: {before or 'nothing the selectors choose'}"
        )
    return lines


def _allocation_lines(allocation: dict[str, Any]) -> list[str]:
    """One line per request's devices, then the node selector."""
    by_request: dict[str, list[str]] = {}
    for result in (allocation.get("devices") or {}).get("results") or []:
        where = f"{result['driver']}/{result['pool']}/{result['device']}"
        by_request.setdefault(result["request"], []).append(where)
    lines = [f"  {request}: {', '.join(devices)}" for request, devices in by_request.items()]
    terms = (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []
    for term in terms:
        for field in term.get("matchFields") or []:
            values = ", ".join(field.get("values") or [])
            lines.append(f"  node: {field['key']} {field['operator']} [{values}]")
    return lines


def _clip(line: str) -> str:
    return line if len(line) <= MAX_WIDTH else line[: MAX_WIDTH - 3] + "..."
