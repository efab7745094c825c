"""`kvpilot simulate`: a discrete-event simulator to compare autoscaling policies on traces."""

from kvpilot.operator.autoscaling.simulator.cli import main

__all__ = ["main"]
