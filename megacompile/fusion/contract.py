"""The contract between a training template's forward and backward graphs, kept while both change.

forward:  (params..., acts...) -> (outputs..., saved...)
backward: (params[bwd_params]..., acts[bwd_acts]..., saved..., tangents...) -> grads

`StagePair` holds copies of both graphs and the two lists that tie them: `saved` (forward nodes, in
order) and `saved_in` (the backward placeholders that receive them). A rewrite may stop reading a
saved value or an input in the backward (`prune` then drops it on both sides, so the forward stops
keeping it alive) or add a saved value (`add_saved`: a backward placeholder now, the forward node
when the forward rewrite makes it). `template()` writes the result back into a new StageTemplate
with its memory simulated again.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from megacompile.capture.stage import StageTemplate, TensorMeta
from megacompile.ir.stage_program import StageProgram

from .graph import GraphEdit, copy_module
from .match import first_match, peel


class StagePair:
    def __init__(self, template: StageTemplate):
        self.source = template
        self.fwd = GraphEdit(copy_module(template.forward.gm))
        self.bwd = GraphEdit(copy_module(template.backward.gm))
        self.n_params = len(template.params)
        self.n_outputs = len(template.outputs)
        self.bwd_params = list(template.bwd_params)
        self.bwd_acts = list(template.bwd_acts)
        self.pending: list[fx.Node] = []   # backward placeholders whose forward node is not made yet
        ph = self._placeholders(self.bwd.graph)
        n_in, n_saved = len(self.bwd_params) + len(self.bwd_acts), len(self.saved)
        self.inputs_in = ph[:n_in]
        self.saved_in = ph[n_in:n_in + n_saved]
        self.tangents = ph[n_in + n_saved:]
        assert len(self.tangents) == len(template.tangent_outputs), "backward placeholders break the contract"
        self.fwd_inputs = self._placeholders(self.fwd.graph)

    @staticmethod
    def _placeholders(graph: fx.Graph) -> list[fx.Node]:
        return [n for n in graph.nodes if n.op == "placeholder"]

    @property
    def _fwd_output(self) -> fx.Node:
        return next(n for n in reversed(self.fwd.graph.nodes) if n.op == "output")

    @property
    def outputs(self) -> list:
        return list(self._fwd_output.args[0])[:self.n_outputs]

    @property
    def saved(self) -> list[fx.Node | None]:
        """The forward's saved nodes, read from its output (rewrites replace them), then None for
        each pending placeholder."""
        return list(self._fwd_output.args[0])[self.n_outputs:] + [None] * len(self.pending)

    # -- reading across the pair -----------------------------------------------------------
    def _input_index(self, k: int) -> int:
        n_bp = len(self.bwd_params)
        return self.bwd_params[k] if k < n_bp else self.n_params + self.bwd_acts[k - n_bp]

    def forward_of(self, node: fx.Node) -> fx.Node | None:
        """The forward node a backward placeholder receives (a saved value, a param, an act)."""
        node = peel(node)
        if node in self.saved_in:
            return self.saved[self.saved_in.index(node)]
        if node in self.inputs_in:
            return self.fwd_inputs[self._input_index(self.inputs_in.index(node))]
        return None

    def backward_of(self, node: fx.Node) -> fx.Node | None:
        """The backward placeholder that receives forward node `node`, if any."""
        for s, ph in zip(self.saved, self.saved_in):
            if s is node:
                return ph
        if node in self.fwd_inputs:
            index = self.fwd_inputs.index(node)
            for k, ph in enumerate(self.inputs_in):
                if self._input_index(k) == index:
                    return ph
        return None

    def holds(self, pattern, node: fx.Node, bound: dict) -> bool:
        """`node` (in the backward) is `pattern` over the `bound` nodes: computed so in the backward
        itself, or received from a forward node computed so over the bound nodes' forward values."""
        if first_match(pattern, node, bound) is not None:
            return True
        f_node = self.forward_of(node)
        f_bound = {k: self.forward_of(v) if isinstance(v, fx.Node) else v for k, v in bound.items()}
        if f_node is None or any(v is None for v in f_bound.values()):
            return False
        return first_match(pattern, f_node, f_bound) is not None

    # -- changing the contract -------------------------------------------------------------
    def add_saved(self, name: str, fake) -> fx.Node:
        """A new backward placeholder after the saved ones; `set_saved` gives its forward node later."""
        graph = self.bwd.graph
        anchor = self.tangents[0] if self.tangents else None
        if anchor is None:
            others = [n for n in graph.nodes if n.op != "placeholder"]
            anchor = others[0]
        with graph.inserting_before(anchor):
            ph = graph.placeholder(name)
        ph.meta["val"] = fake
        self.saved_in.append(ph)
        self.pending.append(ph)
        return ph

    def input_for(self, node: fx.Node) -> fx.Node:
        """A backward placeholder receiving forward value `node`: the one there is, else a new act or
        param input (node is a forward placeholder) or a new saved value (any other forward node)."""
        found = self.backward_of(node)
        if found is not None:
            return found
        assert not self.pending, "promised saved values come first"
        if node not in self.fwd_inputs:
            ph = self.add_saved(f"saved_{node.name}", node.meta["val"])
            self.set_saved(ph, node)
            return ph
        index = self.fwd_inputs.index(node)
        is_param = index < self.n_params
        n_bp = len(self.bwd_params)
        section = self.inputs_in[:n_bp] if is_param else self.inputs_in
        graph = self.bwd.graph
        with (graph.inserting_after(section[-1]) if section else graph.inserting_before(next(iter(graph.nodes)))):
            ph = graph.placeholder(node.name)
        ph.meta = dict(node.meta)
        if is_param:
            self.bwd_params.append(index)
            self.inputs_in.insert(n_bp, ph)
        else:
            self.bwd_acts.append(index - self.n_params)
            self.inputs_in.append(ph)
        return ph

    def set_saved(self, placeholder: fx.Node, node: fx.Node) -> None:
        assert self.pending and self.pending[0] is placeholder, "saved values are made in the order promised"
        self.pending.pop(0)
        out = self._fwd_output
        out.args = (tuple(out.args[0]) + (node,),)

    def prune(self) -> None:
        """Drop backward inputs nothing reads any more: saved values on both sides, params and acts
        from bwd_params/bwd_acts (so the schedule stops keeping them for the backward)."""
        self.bwd.dce()
        saved = self.saved
        keep = [k for k, ph in enumerate(self.saved_in) if ph.users or ph in self.pending]
        for k, ph in enumerate(self.saved_in):
            if k not in keep:
                self.bwd.graph.erase_node(ph)
        out = self._fwd_output
        out.args = (tuple(self.outputs) + tuple(saved[k] for k in keep if saved[k] is not None),)
        self.fwd.touched.extend(saved[k] for k in range(len(saved)) if k not in keep and saved[k] is not None)
        self.saved_in = [self.saved_in[k] for k in keep]
        params, acts, inputs = [], [], []
        for k, ph in enumerate(self.inputs_in):
            if not ph.users:
                self.bwd.graph.erase_node(ph)
                continue
            inputs.append(ph)
            (params if k < len(self.bwd_params) else acts).append(
                self.bwd_params[k] if k < len(self.bwd_params) else self.bwd_acts[k - len(self.bwd_params)])
        self.bwd_params, self.bwd_acts, self.inputs_in = params, acts, inputs
        self.fwd.dce()

    # -- writing back ----------------------------------------------------------------------
    def template(self) -> StageTemplate:
        assert not self.pending, "a saved value was promised but never made"
        self.fwd.dce()
        self.bwd.dce()
        for edit in (self.fwd, self.bwd):
            edit.graph.lint()
            edit.gm.recompile()
        forward, backward = StageProgram(self.fwd.gm), StageProgram(self.bwd.gm)
        return dataclasses.replace(
            self.source, forward=forward, backward=backward,
            saved=[TensorMeta.of(n.meta["val"], False) for n in self.saved],
            bwd_params=self.bwd_params, bwd_acts=self.bwd_acts,
            fwd_memory=forward.simulate(), bwd_memory=backward.simulate())
