"""The embedding's backward onto kernels/embedding.py, so its [V, H] result is written into the arena.

    aten.embedding_dense_backward(grad, ids, num_weights, padding_idx, scale_grad_by_freq=False)

ATen's op allocates its result and, on a GPU, a float32 partial sum per token row beside it, and
its `out=` form only copies the result in: op scratch beside the arena of the table's size and more
(docs/decisions.md, "An out= form torch generates is scratch"). The kernel takes its result from the
arena and allocates only the sorted ids. Rewritten where it computes what the op does: no
scale_grad_by_freq (a token's rows scaled by its count), a floating gradient of the kernel's dtypes.
"""
from __future__ import annotations

import torch

from .graph import GraphEdit, alive
from .launchers import embedding_bwd
from .match import is_call, val

aten = torch.ops.aten


def embedding_backward(edit: GraphEdit) -> int:
    count = 0
    for node in list(edit.graph.nodes):
        if not alive(node) or not is_call(node, {aten.embedding_dense_backward.default}):
            continue
        grad, ids, num_weights, padding_idx, by_freq = node.args[:5]
        g, i = val(grad), val(ids)
        if by_freq or not isinstance(g, torch.Tensor) or not isinstance(i, torch.Tensor) \
                or g.dtype not in (torch.float32, torch.bfloat16, torch.float16) or i.is_floating_point() \
                or tuple(g.shape[:-1]) != tuple(i.shape):
            continue
        if edit.replace(embedding_bwd, (grad, ids, num_weights, padding_idx), {}, {0: node}, [node]):
            if not node.users:
                edit.graph.erase_node(node)
            count += 1
    return count
