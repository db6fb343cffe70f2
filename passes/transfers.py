"""Stream weights in and gradients out: PREFETCH / WAIT / FREE (an eviction) for weights, OFFLOAD / WAIT for grads.

Weights live on the host and come to the device once per pass that uses them (forward, then
backward: twice per step). With `depth` = d, the prefetch of a stage's weights is issued d compute
nodes before their first use, so the copy runs while those nodes compute (d = 1: double
buffering). A stage used by back-to-back compute nodes (the epilogue's forward and backward, a
recompute and its backward) keeps its weights across them instead of fetching twice. Gradients
are offloaded right after the backward that makes them; with depth >= 1 compute waits for that
copy one compute node later, so it overlaps the next backward (depth 0, the smallest plan,
waits at once and frees the gradients before the next stage's weights arrive).
"""
from __future__ import annotations

from megacompile.ir.program import COMPUTE_OPS, Node, Op, Program, grads, weights


def transfers(program: Program, depth: int, refetch_per_pass: bool = False,
              resident: frozenset[int] = frozenset()) -> Program:
    """`refetch_per_pass`: every recompute fetches the weights again (a backward still shares the
    fetch of the recompute right before it), as schedules that stream each pass separately do.
    `resident`: stages whose weights are fetched once and stay from first use to last use."""
    nodes = program.nodes
    compute_at = [i for i, n in enumerate(nodes) if n.op in COMPUTE_OPS]
    # Runs of back-to-back uses of the same weights: (stage, first compute index, last compute index)
    runs: list[list[int]] = []
    for rank, i in enumerate(compute_at):
        s = nodes[i].stage
        split = refetch_per_pass and nodes[i].op is Op.RECOMPUTE
        if runs and runs[-1][0] == s and runs[-1][2] == compute_at[rank - 1] and not split:
            runs[-1][2] = i
        elif s in resident and any(r[0] == s for r in runs):
            next(r for r in runs if r[0] == s)[2] = i
        else:
            runs.append([s, i, i])
    before: dict[int, list[Node]] = {}
    after: dict[int, list[Node]] = {}
    rank_of = {i: r for r, i in enumerate(compute_at)}
    last_use: dict[int, int] = {}     # stage -> compute index where its previous run ended
    for s, first, last in runs:
        issue_at = compute_at[max(rank_of[first] - depth, 0)]
        prefetch = Node(Op.PREFETCH, s, writes=(weights(s),), origin=nodes[first].origin,
                        note=(f"overlaps {nodes[issue_at].op.value} {program.stage_names[nodes[issue_at].stage]}"
                              if issue_at != first else "not overlapped"))
        if s in last_use and rank_of[last_use[s]] >= rank_of[issue_at]:
            # The same weights are still in use by the previous run: fetch again right after
            # that run evicts them, never into a buffer still being read.
            after.setdefault(last_use[s], []).append(prefetch)
        else:
            before.setdefault(issue_at, []).append(prefetch)
        last_use[s] = last
        before.setdefault(first, []).append(Node(Op.WAIT, s, reads=(weights(s),), origin=nodes[first].origin))
        after.setdefault(last, []).append(Node(Op.FREE, s, frees=(weights(s),), origin=nodes[last].origin,
                                               note="evict"))
    for rank, i in enumerate(compute_at):
        n = nodes[i]
        if n.op is Op.BACKWARD and grads(n.stage) in n.writes:
            after.setdefault(i, []).append(Node(Op.OFFLOAD, n.stage, reads=(grads(n.stage),), origin=n.origin))
            wait_at = compute_at[rank + 1] if depth > 0 and rank + 1 < len(compute_at) else i
            after.setdefault(wait_at, []).append(Node(Op.WAIT, n.stage, reads=(grads(n.stage),), origin=n.origin))
            after[wait_at].append(Node(Op.FREE, n.stage, frees=(grads(n.stage),), origin=n.origin))
    # Evictions land after the compute node that last used the weights, so they come before
    # the prefetches issued ahead of the next compute node: the memory is released first.
    out: list[Node] = []
    for i, n in enumerate(nodes):
        pending = before.get(i, [])
        out.extend(p for p in pending if p.op is Op.PREFETCH)
        out.extend(p for p in pending if p.op is Op.WAIT)
        out.append(n)
        out.extend(after.get(i, []))
    return program.copy(out, prefetch_depth=depth)

