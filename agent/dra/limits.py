"""The ResourceSlice API limits this model enforces, in one place.

Values come from ``k8s.io/api/resource/v1`` (see kubelet-dra-protocol.md §4). Where a
limit changed between releases, the constant says which release it belongs to and the
model enforces the one named ``*_ENFORCED``.
"""

from typing import Final

#: ``ResourceSliceMaxDevices``: devices in one slice.
MAX_DEVICES_PER_SLICE: Final = 128
#: ``ResourceSliceMaxDevicesWithAdvancedFeatures`` (1.35+): devices in one slice when any
#: of them has taints or consumesCounters. Enforced for every version: on 1.34 it is
#: merely stricter than needed.
MAX_DEVICES_PER_SLICE_WITH_TAINTS: Final = 64
#: ``ResourceSliceMaxAttributesAndCapacitiesPerDevice``.
MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE: Final = 32
#: Taints per device on 1.35 and later.
MAX_TAINTS_PER_DEVICE: Final = 16
#: Taints per device on 1.34 (``DRADeviceTaints`` is alpha and off by default there).
MAX_TAINTS_PER_DEVICE_1_34: Final = 4
#: ``DeviceAttributeMaxValueLength``: string and version attribute values.
MAX_ATTRIBUTE_VALUE_LENGTH: Final = 64
#: ``DeviceMaxIDLength``: the C-identifier part of an attribute or capacity name.
MAX_ID_LENGTH: Final = 32
#: ``DeviceMaxDomainLength``: the domain prefix of an attribute or capacity name.
MAX_DOMAIN_LENGTH: Final = 63
#: ``DriverNameMaxLength``.
MAX_DRIVER_NAME_LENGTH: Final = 63
#: DNS label (device names, label values).
MAX_DNS_LABEL_LENGTH: Final = 63
#: DNS subdomain (node names, pool names, object names).
MAX_DNS_SUBDOMAIN_LENGTH: Final = 253
