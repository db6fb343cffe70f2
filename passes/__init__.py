"""Scheduling passes: pure functions from schedule to schedule, run by pipeline.build_schedule."""
from .pipeline import ScheduleChoice, StepKind, build_schedule
from .solve import solve

__all__ = ["ScheduleChoice", "StepKind", "build_schedule", "solve"]
