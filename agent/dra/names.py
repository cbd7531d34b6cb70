"""Naming and validation rules for DRA devices, attributes and versions.

Device names must stay exactly those of the incumbent NVIDIA driver (nvidia-driver-facts.md
§2.2): claims, CEL selectors and dashboards written against it keep working when a node
switches to this agent. Attribute names and values must pass the API server's validation,
which these functions mirror so that a bad value fails here, with the device named, rather
than as a rejected ResourceSlice write.
"""

from __future__ import annotations

import re

from agent.dra import limits
from agent.dra.errors import InvalidNameError, InvalidValueError

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
# Semantic Versioning 2.0.0, the grammar the API server uses for version attributes.
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-((0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(\.(0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(\+([0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*))?"
)
_NUMERIC_VERSION = re.compile(r"\d+(\.\d+){0,2}")
_MIG_DEVICE_NAME = re.compile(r"gpu-(\d+)-mig-(.+)-(\d+)-(\d+)")


def is_dns_label(value: str) -> bool:
    """RFC 1123 label: lower-case alphanumerics and '-', at most 63 characters."""
    return len(value) <= limits.MAX_DNS_LABEL_LENGTH and _DNS_LABEL.fullmatch(value) is not None


def is_dns_subdomain(value: str, max_length: int = limits.MAX_DNS_SUBDOMAIN_LENGTH) -> bool:
    """RFC 1123 subdomain: dot-separated labels, at most ``max_length`` characters."""
    return len(value) <= max_length and _DNS_SUBDOMAIN.fullmatch(value) is not None


def is_c_identifier(value: str) -> bool:
    """A C identifier of at most 32 characters, the unqualified part of a QualifiedName."""
    return len(value) <= limits.MAX_ID_LENGTH and _C_IDENTIFIER.fullmatch(value) is not None


def qualified_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid attribute or capacity name, or None if it is.

    A QualifiedName is a C identifier, optionally prefixed by ``<domain>/``. The API server
    fails to reject a second '/' (a known bug); we reject it, since such a name cannot be
    addressed from CEL.
    """
    domain, slash, identifier = name.rpartition("/")
    if slash:
        if "/" in domain:
            return "contains more than one '/'"
        if not is_dns_subdomain(domain, limits.MAX_DOMAIN_LENGTH):
            return (
                f"domain {domain!r} is not a DNS subdomain of at most "
                f"{limits.MAX_DOMAIN_LENGTH} characters"
            )
    if not is_c_identifier(identifier):
        return (
            f"{identifier!r} is not a C identifier ([A-Za-z_][A-Za-z0-9_]*) of at most "
            f"{limits.MAX_ID_LENGTH} characters"
        )
    return None


def validate_qualified_name(name: str, *, device: str) -> None:
    """Raise InvalidNameError unless ``name`` is a valid attribute or capacity name."""
    problem = qualified_name_problem(name)
    if problem is not None:
        raise InvalidNameError(f"device {device!r}: attribute/capacity name {name!r} {problem}")


def validate_device_name(name: str) -> None:
    """Raise InvalidNameError unless ``name`` is a DNS label (what the API requires)."""
    if not is_dns_label(name):
        raise InvalidNameError(
            f"device name {name!r} is not a DNS label (lower-case alphanumerics and '-', "
            f"starting and ending alphanumeric, at most {limits.MAX_DNS_LABEL_LENGTH} characters)"
        )


def validate_driver_name(name: str) -> None:
    """Raise InvalidNameError unless ``name`` is a valid DRA driver name."""
    if not is_dns_subdomain(name, limits.MAX_DRIVER_NAME_LENGTH):
        raise InvalidNameError(
            f"driver name {name!r} must be a lower-case DNS subdomain of at most "
            f"{limits.MAX_DRIVER_NAME_LENGTH} characters, e.g. 'gpu.nvidia.com'; fix the "
            "driver name setting"
        )


def validate_node_name(name: str) -> None:
    """Raise InvalidNameError unless ``name`` can be a node name and a pool name."""
    if not is_dns_subdomain(name):
        raise InvalidNameError(
            f"node name {name!r} is not a DNS subdomain of at most "
            f"{limits.MAX_DNS_SUBDOMAIN_LENGTH} characters; pass the Kubernetes node name"
        )


def label_key_problem(key: str) -> str | None:
    """Why ``key`` is not a valid label key (used for taint keys), or None if it is."""
    prefix, slash, name = key.rpartition("/")
    if slash and not is_dns_subdomain(prefix):
        return f"prefix {prefix!r} is not a DNS subdomain"
    if len(name) > limits.MAX_DNS_LABEL_LENGTH or _LABEL_NAME.fullmatch(name) is None:
        return f"name part {name!r} is not a label name of at most 63 characters"
    return None


def is_label_value(value: str) -> bool:
    """A label value: empty, or a label name of at most 63 characters."""
    return value == "" or (
        len(value) <= limits.MAX_DNS_LABEL_LENGTH and _LABEL_NAME.fullmatch(value) is not None
    )


def is_semver(value: str) -> bool:
    """Whether ``value`` is a Semantic Versioning 2.0.0 version."""
    return _SEMVER.fullmatch(value) is not None


def semver_from_numeric(version: str) -> str:
    """Normalize an NVIDIA ``major[.minor[.patch]]`` version to SemVer.

    Leading zeros are dropped and missing parts become 0, as the incumbent does:
    ``"570.158.01"`` -> ``"570.158.1"``, ``"565.57"`` -> ``"565.57.0"``, ``"12.8"`` -> ``"12.8.0"``.
    """
    text = version.strip()
    if _NUMERIC_VERSION.fullmatch(text) is None:
        raise InvalidValueError(
            f"version {version!r} is not of the form major[.minor[.patch]] with decimal parts; "
            "the NVIDIA driver reported something unexpected"
        )
    parts = [int(part) for part in text.split(".")]
    parts += [0] * (3 - len(parts))
    return ".".join(str(part) for part in parts)


def rfc1123_profile(profile_name: str) -> str:
    """The MIG profile name as it appears in device names.

    Dots are removed, the rest is lower-cased, and anything outside ``[a-z0-9-]`` becomes '-':
    ``"1g.10gb"`` -> ``"1g10gb"``, ``"1g.10gb+me"`` -> ``"1g10gb-me"``.
    """
    lowered = profile_name.replace(".", "").lower()
    return "".join(
        ch if ("a" <= ch <= "z" or "0" <= ch <= "9" or ch == "-") else "-" for ch in lowered
    )


def gpu_device_name(minor: int) -> str:
    """The name of a full-GPU device: ``gpu-<minor>`` (the NVML minor number, not the index)."""
    return f"gpu-{minor}"


def mig_device_name(
    parent_minor: int, profile_name: str, gi_profile_id: int, placement_start: int
) -> str:
    """The name of a MIG device: ``gpu-<parentMinor>-mig-<profile>-<giProfileId>-<placementStart>``."""
    profile = rfc1123_profile(profile_name)
    return f"gpu-{parent_minor}-mig-{profile}-{gi_profile_id}-{placement_start}"


def parse_mig_device_name(name: str) -> tuple[int, str, int, int] | None:
    """Split a MIG device name into (parent minor, profile, GI profile id, placement start).

    Returns None for names that are not MIG device names. The profile is the RFC 1123 form.
    """
    match = _MIG_DEVICE_NAME.fullmatch(name)
    if match is None:
        return None
    minor, profile, gi_profile_id, start = match.groups()
    return int(minor), profile, int(gi_profile_id), int(start)


def device_sort_key(name: str) -> tuple[tuple[tuple[int, int | str], ...], str]:
    """Order device names the way people count: ``gpu-2`` before ``gpu-10``.

    Digit runs compare as numbers and everything else as text, so the order is total and
    deterministic (ties between, say, ``gpu-01`` and ``gpu-1`` fall back to the text).
    """
    parts: list[tuple[int, int | str]] = []
    for run in re.findall(r"\d+|\D+", name):
        parts.append((0, int(run)) if run.isdigit() else (1, run))
    return tuple(parts), name
