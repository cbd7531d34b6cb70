"""Dynamic MIG: GPU and compute instances made on prepare, destroyed on unprepare.

``MigEffector`` is the engine's device effector for the MIG devices ``--dynamic-mig``
publishes (``agent.node.effectors`` is the protocol, ``rules`` the exclusivity rules).
"""

from agent.mig.effector import MigEffector
from agent.mig.steps import export_at_zero as metrics_at_zero

__all__ = ["MigEffector", "metrics_at_zero"]
