"""Two-phase (cross-AZ) reservations' driver (docs/two-phase.md "Driver"):
``TwoPhaseDriver`` (driver.py) and the parts it builds."""

from coordinator.twophase.driver import TwoPhaseDriver

__all__ = ["TwoPhaseDriver"]
