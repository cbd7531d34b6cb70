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
#: KEP-5007: bindingConditions and bindingFailureConditions, each
MAX_BINDING_CONDITIONS: Final = 4
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

# -- KEP-4815 partitionable devices (sharedCounters / consumesCounters) ---------------------
#: ``ResourceSliceMaxSharedCounters`` (1.34): counters of all sets of one slice together.
MAX_SHARED_COUNTERS_PER_SLICE_1_34: Final = 32
#: ``ResourceSliceMaxCounterSets`` (1.35+): counter sets in one (counters-only) slice.
MAX_COUNTER_SETS_PER_SLICE: Final = 8
#: ``ResourceSliceMaxCountersPerCounterSet`` (1.35+): counters in one set (1.34: in all sets).
MAX_COUNTERS_PER_SET: Final = 32
#: ``ResourceSliceMaxDeviceCounterConsumptionsPerDevice`` (1.35+): consumesCounters entries.
MAX_COUNTER_CONSUMPTIONS_PER_DEVICE: Final = 2
#: Counters one device consumes: 32 in all its entries on 1.34, 32 per entry on 1.35+.
#: Enforced as 32 in all entries, valid on both.
MAX_COUNTERS_PER_DEVICE: Final = 32
#: ``ResourceSliceMaxDeviceCountersPerSlice`` (1.34): counters consumed by all devices of
#: one slice together.
MAX_CONSUMED_COUNTERS_PER_SLICE_1_34: Final = 1024
