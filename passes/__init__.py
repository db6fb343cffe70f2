"""Scheduling passes: pure functions from schedule to schedule, run by pipeline.build_schedule."""
from .pipeline import ScheduleChoice, StepKind, build_schedule

__all__ = ["ScheduleChoice", "StepKind", "build_schedule"]
