"""Per block of a plan, what the solver decided and why: how its saved values are held between
the passes (kept, offloaded, recomputed), whether it saves only the costly ones, the device bytes
at stake and the seconds paid; as records (Plan.blocks, the JSON) and as the summary's lines."""
from __future__ import annotations

from ..ir.printer import fmt_bytes, fmt_seconds
from ..ir.program import Op, base_name


def blocks(plan) -> list[dict]:
    """Per block, what the solver decided and why: how its saved values are held between the
    passes ("keep", "offload" or "recompute"), whether it saves only the costly ones, the
    device bytes at stake and the seconds paid (with a hardware profile)."""
    if not plan.captured.train:
        return []
    from ..cost import graph_cost
    from ..cost.predict import compute_seconds
    recomputed = {n.stage for n in plan.program.nodes if n.op is Op.RECOMPUTE}
    offloaded = set(plan.program.facts.get("offload", []))
    sent = set(plan.program.facts.get("boundary_values", []))
    forwards = {n.stage: n for n in plan.program.nodes if n.op is Op.FORWARD}
    template_of = block_template_index(plan)
    records = []
    for s, stage in enumerate(plan.captured.stages):
        t = stage.template
        if t.kind != "block":
            continue
        hold = "recompute" if s in recomputed else "offload" if s in offloaded else "keep"
        # Per micro-batch: a layer-major program names micro-batch m's values `<name>@m`.
        saved_bytes = plan.program.values[next(w for w in forwards[s].writes if base_name(w) == f"saved{s}")].nbytes
        forward = forwards[s]
        input_bytes = sum(plan.program.values[v].nbytes for v in forward.reads if base_name(v) in sent)
        r = {"stage": plan.program.stage_names[s], "template": template_of[s], "hold": hold,
             "saved_bytes": saved_bytes, "selective": t.full is not None, "input_to_host_bytes": input_bytes}
        if t.full is not None:
            r["selective_bytes_not_saved"] = t.full.saved_bytes - t.saved_bytes
        if plan.hardware is not None:
            hw, dtype = plan.hardware, plan.captured.compute_dtype
            r["forward_s"] = compute_seconds(plan.captured, forwards[s], hw)[0]   # what recompute pays
            if hold == "offload":
                r["link_s_each_way"] = saved_bytes / hw.d2h_bw
            if t.full is not None:
                r["selective_backward_s"] = (graph_cost(t.backward, hw, dtype).seconds
                                             - graph_cost(t.full.backward, hw, dtype).seconds)
        records.append(r)
    return records


def block_template_index(plan) -> dict[int, int]:
    """Per block stage, which of the distinct block templates it runs (0, 1, ..., in the order
    of their first block); a selective variant counts as the template it replaces."""
    index: dict[int, int] = {}
    order: dict[int, int] = {}
    for s, stage in enumerate(plan.captured.stages):
        if stage.template.kind == "block":
            full = stage.template.full or stage.template
            index[s] = order.setdefault(id(full), len(order))
    return index


def block_decisions(plan) -> list[str]:
    """blocks() as text, grouped over runs of blocks with the same decision."""
    groups: list[list[dict]] = []
    for r in blocks(plan):
        if groups and all(groups[-1][-1][k] == r[k] for k in DECISION):
            groups[-1].append(r)
        else:
            groups.append([r])
    lines = []
    several = len({r["template"] for g in groups for r in g}) > 1
    for g, span in periodic(groups):
        r = g[0]
        held = fmt_bytes(r["saved_bytes"])
        cost = f", costs {fmt_seconds(r['forward_s'])} of forward each" if "forward_s" in r else ""
        if r["hold"] == "recompute":
            line = f"recompute: frees {held} each between forward and backward{cost}"
        elif r["hold"] == "offload":
            link = (f", {fmt_seconds(r['link_s_each_way'])} over the link each way, beside compute"
                    if "link_s_each_way" in r else "")
            line = f"offload: {held} each waits in host memory between forward and backward{link}"
        else:
            line = f"keep: holds {held} each from forward to backward (recompute would save that{cost})"
        if r["selective"]:
            line += (f"; saves only matmul and attention outputs, {fmt_bytes(r['selective_bytes_not_saved'])} "
                     "less")
            if "selective_backward_s" in r:
                line += f", for {fmt_seconds(r['selective_backward_s'])} of cheap ops redone in its backward"
        if r["input_to_host_bytes"]:
            line += f"; its input ({fmt_bytes(r['input_to_host_bytes'])}) waits in host memory too"
        if several:
            line = f"[template {r['template']}] {line}"
        lines.append(f"  {span:<14} {line}")
    return lines


# A pattern of groups repeated this many times or more prints once: the solver's mixes of offload and
# recompute (one block in four recomputed, say) otherwise print a line per group, 40 for a 70B.
REPEATS = 3
DECISION = ("hold", "selective", "template", "saved_bytes", "input_to_host_bytes")


def periodic(groups: list[list[dict]]) -> list[tuple[list[dict], str]]:
    """The groups with their span's text, a run of groups that repeats a pattern of up to four
    groups REPEATS times or more folded into one per group of the pattern ("block.1..block.79,
    3 of every 4 (60 blocks)"); the rest as they are."""
    def same(a: list[dict], b: list[dict]) -> bool:
        return len(a) == len(b) and all(a[0][k] == b[0][k] for k in DECISION)

    out: list[tuple[list[dict], str]] = []
    i = 0
    while i < len(groups):
        best = (1, 0)     # (repeats, period in groups)
        for period in range(2, 5):
            n = 1
            while (i + (n + 1) * period <= len(groups)
                   and all(same(groups[i + j], groups[i + n * period + j]) for j in range(period))):
                n += 1
            if n >= REPEATS and n * period > best[0] * best[1]:
                best = (n, period)
        n, period = best
        if period == 0:
            g = groups[i]
            out.append((g, g[0]["stage"] if len(g) == 1 else f"{g[0]['stage']}..{g[-1]['stage']}"))
            i += 1
            continue
        every = sum(len(groups[i + j]) for j in range(period))
        for j in range(period):
            first, last = groups[i + j], groups[i + (n - 1) * period + j]
            out.append((first, f"{first[0]['stage']}..{last[-1]['stage']}, {len(first)} of every {every} "
                               f"({n * len(first)} blocks)"))
        i += n * period
    return out


def recompute_why(plan) -> list[dict]:
    """For each recomputed block: the device bytes it frees between its passes, the seconds it costs."""
    out = []
    for n in plan.program.nodes:
        if n.op is Op.RECOMPUTE:
            seconds = None
            if plan.hardware is not None:
                from ..cost.predict import compute_seconds
                seconds = compute_seconds(plan.captured, n, plan.hardware)[0]
            out.append({"stage": plan.program.stage_names[n.stage],
                        "saved_bytes": plan.program.values[n.writes[0]].nbytes, "seconds": seconds})
    return out
