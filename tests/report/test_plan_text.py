"""The printed plan at scale: runs of like blocks folded (first and last of each run in full), a
legend of value names, a values column that wraps rather than cuts; the unfolded form on request."""
from __future__ import annotations

import re

import pytest

import megacompile
from megacompile.ir.fold import find_runs
from megacompile.ir.printer import fmt_rate, fmt_seconds, format_program
from megacompile.ir.program import Node, Op, Program, Value
from tests import models

NODE = re.compile(r"^[ *]\s*(\d+)\s")
FOLD = re.compile(r"^ \s*(\d+)\s+\.\.(\d+)\s+(\S+) \.\. (\S+): same as (\S+), offset by (one|minus one)")


def _stack(blocks: int, odd: int | None = None) -> Program:
    """prefetch, wait, forward, free per block; block `odd` saves more than the others."""
    names = ["prologue"] + [f"block.{b}" for b in range(blocks)]
    values = {"x0.0": Value("x0.0", (("x0.0", 8),), "activation")}
    nodes = [Node(Op.INPUT, writes=("x0.0",))]
    for s in range(1, blocks + 1):
        saved = 64 if s - 1 == odd else 32
        values[f"w{s}"] = Value(f"w{s}", ((f"w{s}", 100),), "weights")
        values[f"x{s}.0"] = Value(f"x{s}.0", ((f"x{s}.0", 8),), "activation")
        values[f"saved{s}"] = Value(f"saved{s}", ((f"saved{s}", saved),), "saved")
        nodes += [Node(Op.PREFETCH, s, writes=(f"w{s}",), origin=f"layers.{s - 1}"),
                  Node(Op.WAIT, s, reads=(f"w{s}",), origin=f"layers.{s - 1}"),
                  Node(Op.FORWARD, s, reads=(f"w{s}", f"x{s - 1}.0", "x0.0"), writes=(f"x{s}.0", f"saved{s}"),
                       origin=f"layers.{s - 1}"),
                  Node(Op.FREE, s, frees=(f"w{s}",), origin=f"layers.{s - 1}")]
    return Program(nodes, values, names, ["hand"])


def _covered(text: str) -> list[int]:
    """Node indices the text shows, a fold line standing for its range."""
    seen = []
    for line in text.splitlines():
        if m := FOLD.match(line):
            seen += range(int(m.group(1)), int(m.group(2)) + 1)
        elif m := NODE.match(line):
            seen.append(int(m.group(1)))
    return seen


def test_a_run_of_like_blocks_is_found_and_broken_where_a_block_differs():
    (run,) = find_runs(_stack(12))
    assert (run.start, run.period, run.count, run.shift) == (1, 4, 12, 1)
    # block.6 saves more: one run stops before its forward (node 27), the next starts after it
    runs = find_runs(_stack(16, odd=6))
    assert [(r.start, r.end) for r in runs] == [(1, 25), (28, 64)]


def test_the_folded_text_shows_every_node_once_and_the_full_text_every_node():
    program = _stack(12)
    folded = format_program(program)
    assert _covered(folded) == list(range(len(program.nodes)))
    (fold,) = [FOLD.match(line) for line in folded.splitlines() if FOLD.match(line)]
    assert fold.group(3, 4, 5, 6) == ("block.1", "block.10", "block.0", "one")
    # first and last block of the run in full: block.0's forward and block.11's
    assert "forward         block.0 " in folded and "forward         block.11 " in folded
    assert "forward         block.5 " not in folded
    full = format_program(program, fold=False)
    assert [int(NODE.match(line).group(1)) for line in full.splitlines() if NODE.match(line)] == \
        list(range(len(program.nodes)))


def test_a_long_values_column_wraps_onto_further_lines():
    program = _stack(12)
    dropped = tuple(f"saved{s}" for s in range(1, 13))
    program.nodes.append(Node(Op.FREE, frees=dropped, origin="after last use"))
    lines = format_program(program, fold=False).splitlines()
    first = next(k for k, line in enumerate(lines) if NODE.match(line) and int(NODE.match(line).group(1)) == 49)
    shown = " ".join(lines[first:])
    assert all(re.search(rf"{name}(,|$| )", shown) for name in dropped)
    assert len(lines) - first >= 3 and "after last use" in lines[first]


@pytest.fixture(scope="module")
def plan():
    model = models.NanoGPT(vocab=96, d=32, layers=8, heads=4)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    ids = models.batch(96, 2, 16)
    plan = engine.prepare(idx=ids, targets=ids)
    engine.close()
    return plan


def test_a_compiled_plan_folds_with_a_legend_and_never_cuts_a_value(plan):
    folded, full = str(plan), plan.format(full=True)
    assert folded == plan.format()
    assert len(folded.splitlines()) < len(full.splitlines())
    assert _covered(folded) == list(range(len(plan.program.nodes)))
    legend = " ".join(folded.split("# built by")[0].splitlines())
    for entry in ("w<s>", "x<s>.<k>", "saved<s>", "g<s>", "dx<s>.<k>", "1 block.0"):
        assert entry in legend
    # every value a node names is in its lines (wrapped, not cut)
    lines = full.splitlines()
    starts = [k for k, line in enumerate(lines) if NODE.match(line)] + [len(lines)]
    for (a, b), node in zip(zip(starts, starts[1:]), plan.program.nodes):
        text = " ".join(lines[a:b])
        for name in node.reads + node.writes + node.frees:
            assert re.search(rf"(^|[ ,]){re.escape(name)}(,|$| )", text), (name, text)
    assert "..." not in "\n".join(lines[starts[0]:])


def test_times_print_as_s_ms_or_us_without_exponents(plan):
    for seconds, text in [(10380.0, "10,380 s"), (10.38, "10.4 s"), (0.9997, "1 s"), (0.12345, "123 ms"),
                          (5.82e-3, "5.82 ms"), (1.2e-4, "120 us"), (0.0, "0 s")]:
        assert fmt_seconds(seconds) == text
    for rate, text in [(6.29e-05, "0.0000629"), (0.5, "0.500"), (41.23, "41.2"), (272.4, "272"), (1269.4, "1,269")]:
        assert fmt_rate(rate) == text     # a tiny model on the simulated device runs at 6.29e-05 TFLOPS
    summary = plan.summary()
    assert "per step on" in summary
    assert not re.search(r"\de[+-]\d", summary)


@pytest.mark.slow
def test_an_80_layer_plan_prints_in_at_most_200_lines():
    """Planned from a config, without weights: 80 blocks, some offloaded and some kept."""
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 80,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
    plan = megacompile.plan(config, 0.067, hardware="h100", batch=1, seq=32, fuse=False)
    text = str(plan)
    assert len(text.splitlines()) <= 200
    assert _covered(text) == list(range(len(plan.program.nodes)))
    assert len(plan.format(full=True).splitlines()) >= len(plan.program.nodes) > 1000


def test_plan_command_refuses_output_paths_it_cannot_write_before_planning(tmp_path, capsys, monkeypatch):
    from megacompile.cli import main
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["plan", "--config", str(tmp_path / "never-read.json"), "--hbm-budget", "1"]
    assert main(args + ["--trace", str(blocker / "step.json")]) == 2
    assert "--trace's folder" in capsys.readouterr().err
    assert main(args + ["--plot", str(blocker)]) == 2
    assert "is a file" in capsys.readouterr().err
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert main(args + ["--plot", str(tmp_path / "img")]) == 2
    assert "pip install 'megacompile[plot]'" in capsys.readouterr().err
