"""The forward's layers (runner/precision/layers.py) compose in one fixed order whatever order the
options add them in, and a copied model runs its own copy's layers."""

import copy
import itertools

import pytest
import torch
from torch import nn

from runner.precision import layers
from runner.precision.fp32_islands import keep_fp32
from tasks.module import recompute_in_backward


def _tracer(name: str, trace: list):
    def layer(_module, forward, *args, **kwargs):
        trace.append(name)
        return forward(*args, **kwargs)

    return layer


@pytest.mark.parametrize("order", list(itertools.permutations(layers.ORDER)))
def test_layers_run_outermost_first_in_the_documented_order(order):
    trace: list[str] = []
    module = nn.Linear(2, 2)
    for name in order:
        layers.add(module, name, _tracer(name, trace))
    module(torch.randn(1, 2))
    assert trace == list(layers.ORDER)


def test_checkpointing_outside_an_island_recomputes_it_in_fp32():
    """A checkpointed block that is also an fp32 island: forward and the backward's recompute both
    run in fp32 under bf16 autocast, whichever option was applied first; gradients as unchecked."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 1))
    grads, data = [], torch.randn(3, 4)
    for first_checkpoint in (None, True, False):
        net = copy.deepcopy(plain)
        if first_checkpoint:
            recompute_in_backward(net[0])
        keep_fp32(net, ["0"], "cpu")
        if first_checkpoint is False:
            recompute_in_backward(net[0])
        seen = []
        net[0][0].register_forward_hook(lambda _m, _a, out, seen=seen: seen.append(out.dtype))
        x = data.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(x).float().sum()
        loss.backward()
        assert set(seen) == {torch.float32}
        recomputed = len(seen) == 2
        assert recomputed == (first_checkpoint is not None)  # forward, and again in backward
        grads.append(net[0][0].weight.grad)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[1], grads[2])


def test_a_deep_copy_runs_its_own_layers():
    module = nn.Linear(2, 2)
    layers.add(module, "cast", lambda m, forward, x: forward(x.to(m.weight.dtype)))
    twin = copy.deepcopy(module).to(torch.bfloat16)
    out = twin(torch.randn(1, 2))  # fp32 input cast to the copy's bf16 weights
    assert out.dtype == torch.bfloat16
    assert module(torch.randn(1, 2)).dtype == torch.float32
