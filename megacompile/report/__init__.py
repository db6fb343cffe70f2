"""Seeing a step: its timeline as a Chrome trace (trace.py) and its memory as a picture (plot.py,
over memory.py's bytes by kind). Reads plans and the runtime's record; changes neither."""
from .memory import device_by_kind, host_by_kind
from .outputs import write_run_views
from .trace import trace_events, write_trace

__all__ = ["device_by_kind", "host_by_kind", "trace_events", "write_run_views", "write_trace"]
