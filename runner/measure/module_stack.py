"""Which of the model's modules is running, for the precision manifest's record of the audited
step (runner/measure/matmuls.py): in forward and recomputation by forward hooks, in backward by
the autograd nodes each module's forward made."""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from runner.measure.autograd_edges import made_since
from runner.measure.truth import short
from runner.precision.layers import recomputing


def _depth(name: str) -> int:
    return name.count(".") + 1 if name else 0


def _next_node_number() -> int:
    """The sequence number the next autograd node made on this thread gets (a probe's)."""
    return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1


class ModuleStack:
    """Which of the model's modules is running. In forward, and in a forward that gradient
    checkpointing recomputes in backward, the module's forward hooks enter and leave it. In
    backward, each autograd node belongs to the innermost module whose forward made it (found
    from the module's outputs back to the nodes made before it ran), and a hook before each
    node runs names its module: a gradient that several modules add to (an input shared by a
    LoRA adapter and its base layer) is still each module's own."""

    def __init__(self, model: nn.Module):
        self.names = weakref.WeakKeyDictionary({m: n for n, m in model.named_modules()})
        self._by_name = dict(model.named_modules())  # held only while the audit lasts
        self.probing = False
        self.forward: list[str] = []
        self.recomputed: list[str] = []  # the modules a recomputed forward is inside
        self.backward = ""  # the module whose autograd node runs now
        self.outputs: dict[str, set[str]] = defaultdict(set)  # module → its outputs' dtypes
        self.weights = WeakTensorKeyDictionary()  # tensor → the module name it is a weight of
        self._starts: list[int | None] = []
        self._owned: dict = {}  # autograd node → its module's name
        self._handles: list = []

    def __enter__(self) -> ModuleStack:
        # A recomputation runs its block's forward to the end (not only as far as backward needs
        # it), so each module it enters is left.
        self._early_stop = torch.utils.checkpoint.set_checkpoint_early_stop(False)
        self._early_stop.__enter__()
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._before),
            nn.modules.module.register_module_forward_hook(self._after),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._owned.clear()
        self._early_stop.__exit__(*exc)

    def recomputing(self) -> bool:
        """Whether a forward runs again in backward now: inside a module entered so (ops in an
        autograd Function's forward run with grad off), or `recomputing()`."""
        return bool(self.recomputed) or recomputing()

    def current(self) -> tuple[str, nn.Module | None]:
        """The module running now: its name and the module (None outside the model)."""
        if self.recomputed:
            name = self.recomputed[-1]
        elif torch._C._current_graph_task_id() != -1:
            name = self.backward
        else:
            name = self.forward[-1] if self.forward else ""
        return name, self._by_name.get(name)

    def _before(self, module: nn.Module, args) -> None:
        name = self.names.get(module)
        if name is None:
            return
        (self.recomputed if self.recomputing() else self.forward).append(name)
        # FSDP gathers the weights the forward uses into tensors of their own: those are known here
        for p in module.parameters(recurse=False):
            self.weights[p] = name
        self.probing = True  # the probe's own ops are the audit's, not the model's traffic
        self._starts.append(_next_node_number() if torch.is_grad_enabled() else None)
        self.probing = False

    def _after(self, module: nn.Module, args, output) -> None:
        name = self.names.get(module)
        if name is None:
            return
        running = self.recomputed if self.recomputed else self.forward
        if name in running:
            del running[len(running) - 1 - running[::-1].index(name)]
        start = self._starts.pop() if self._starts else None
        self.outputs[name] |= {short(t.dtype) for t in _tensors(output) if t.is_floating_point()}
        if start is not None:
            self._own(name, start, output)

    def _own(self, name: str, start: int, output) -> None:
        """Claims for `name` the autograd nodes its forward made that no inner module claimed."""
        for node in made_since([t.grad_fn for t in _tensors(output)], start):
            if node not in self._owned:
                self._owned[node] = name
                self._handles.append(node.register_prehook(functools.partial(self._running, name)))

    def _running(self, name: str, _grad_outputs) -> None:
        self.backward = name


def _tensors(value) -> list[torch.Tensor]:
    flat = torch.utils._pytree.tree_flatten(value)[0]
    return [t for t in flat if isinstance(t, torch.Tensor)]
