"""Scheduling passes: pure functions from schedule to schedule, run by pipeline.build_schedule."""
from .pipeline import ScheduleChoice, build_schedule
from .solve import solve

__all__ = ["ScheduleChoice", "build_schedule", "solve"]
