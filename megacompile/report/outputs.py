"""Where the commands put what they show: `megacompile plan --trace/--plot` and the main job's run
directory (its last step's trace and memory picture beside the plan dump)."""
from __future__ import annotations

import os

from .. import arguments
from ..errors import ArgumentError, MegacompileError
from .trace import write_trace


def check_outputs(trace: str | None = None, plot_dir: str | None = None) -> None:
    """Before a long plan or run: the trace file's folder and the picture's folder can be written,
    and the picture can be drawn."""
    if trace is not None:
        arguments.folder("--trace's folder", os.path.dirname(os.path.abspath(trace)), optional=False)
        if os.path.isdir(trace):
            raise ArgumentError(f"--trace {trace} is a folder; give a file path, e.g. {os.path.join(trace, 'step.json')}")
    if plot_dir is not None:
        arguments.folder("--plot", plot_dir, optional=False)
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise MegacompileError("--plot needs matplotlib: pip install 'megacompile[plot]' (or pip install matplotlib)")


def write_plan_views(plan, trace: str | None = None, plot_dir: str | None = None, timeline=None) -> None:
    """`trace`: a Chrome trace file; `plot_dir`: a folder for memory.png. A missing matplotlib is
    an error here: the picture was asked for."""
    if trace is not None:
        write_trace(trace, plan, timeline)
        print(f"  trace          {trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if plot_dir is not None:
        path = os.path.join(plot_dir, "memory.png")
        plan.plot_memory(path)
        print(f"  memory picture {path}")


def write_run_views(engine, run_dir: str, trace: str | None = None) -> None:
    """After the main job's last step: `trace` (default run_dir/step.json) and run_dir/memory.png.
    Without matplotlib the picture is skipped with a note saying how to get it."""
    trace = trace or os.path.join(run_dir, "step.json")
    engine.trace(trace)       # waits for the step's host updates, so they are in the record
    print(f"  trace          {trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    try:
        write_plan_views(engine.plan, plot_dir=run_dir)
    except MegacompileError as e:
        print(f"  memory picture not written: {e}")
