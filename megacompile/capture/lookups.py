"""Parameters a model only looks rows up in: token and position embeddings.

An embedding's forward is a gather, with no multiply-adds, so its table does no matmul work for
the tokens that read it; 6ND leaves such tables out of N, as PaLM's, Megatron's and nanoGPT's
counts do. The captured graphs tell which they are: a parameter that some stage reads, and every
stage reads only as the table of an embedding lookup. A head tied to the embedding reads the same
parameter in a matmul, so a tied table counts (once: the model's state holds it once).
"""
from __future__ import annotations

import torch
import torch.fx as fx

# Its first argument is the table. Other gathers (a routed expert's bias picked by expert id) read
# parameters that 6ND counts, as it counts every parameter but the embeddings.
EMBEDDING = torch.ops.aten.embedding.default


def _only_looked_up(param: fx.Node) -> bool | None:
    """Whether the graph reads `param` only as an embedding's table; None where it does not read it."""
    if not param.users:
        return None
    return all(user.target is EMBEDDING and user.args[0] is param and param not in user.args[1:]
               for user in param.users)


def lookup_params(stages: list) -> set[str]:
    """Names of the state the stages (model_graph.StageInstance) read, and read only as embedding tables."""
    looked_up: set[str] = set()
    otherwise: set[str] = set()
    by_template: dict[int, list[bool | None]] = {}
    for stage in stages:
        template = stage.template
        if id(template) not in by_template:
            program = template.forward or template.inference
            by_template[id(template)] = ([False] * len(template.params) if program is None else
                                         [_only_looked_up(p) for p in program.placeholders[:len(template.params)]])
        for name, only in zip(stage.params, by_template[id(template)]):
            if only is not None:
                (looked_up if only else otherwise).add(name)
    return looked_up - otherwise
