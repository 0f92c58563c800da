"""`model=module`: any `nn.Module` of the user's, built by `_target_`, trained with a loss named by
config. No subclassing: the net sees the dataset's inputs, the loss sees its output."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext

import torch
from hydra.utils import instantiate
from torch import nn
from torch.utils.checkpoint import checkpoint

from runner import console
from runner.errors import UserError, building, first_line
from runner.precision import layers
from runner.task import VALUES, Batch, DataModule, Task
from tasks import adapters
from tasks.losses import (
    CrossEntropy,
    Loss,
    NetOutput,
    batch_target,
    macro_f1,
    make_loss,
    shape_of,
)

PROBE_ITEMS = 64  # checked through the net before training: enough to meet most classes


def blocks(net: nn.Module) -> list[nn.Module]:
    """The net's repeated blocks: the children of its `nn.ModuleList` or `nn.Sequential` of two
    or more modules of one class that holds the most parameters (a transformer's layers, not a
    layer's MLP; a CNN's residual blocks), the outermost one on a tie; in a net without one, the
    children of its longest (an MLP's layers). FSDP shards them one by one; gradient
    checkpointing recomputes them; keep_bf16 keeps its first and last."""
    lists = [
        m for m in net.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1
    ]
    alike = [m for m in lists if len({type(b) for b in m}) == 1 and _size(m)]
    best = max(alike, key=_size) if alike else max(lists, key=len, default=[])
    return list(best)


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _checkpointed(_block: nn.Module, forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing to save
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def recompute_in_backward(block: nn.Module) -> None:
    """Gradient checkpointing: the block keeps only its inputs for backward and runs its forward
    again there (the outermost layer of its forward, runner/precision/layers.py, so islands and
    casts inside it run again too). torch's non-reentrant checkpoint re-enters the autocast
    state of the forward, so the recomputation runs in the precision the forward ran in."""
    layers.add(block, "checkpoint", _checkpointed)


def freeze_parameters(net: nn.Module, prefixes: Sequence[str]) -> None:
    """`model.freeze`: parameters named `prefix` or `prefix.*` (names as in the net's
    `named_parameters()`) get no gradient and no optimizer state."""
    named = dict(net.named_parameters())
    for prefix in prefixes:
        hits = [n for n in named if n == prefix or n.startswith(f"{prefix}.")]
        if not hits:
            tops = sorted({n.split(".")[0] for n in named})
            raise UserError(
                f"model.freeze: {prefix!r} names no parameter of the net (its top-level "
                f"modules: {', '.join(tops)})"
            )
        for name in hits:
            named[name].requires_grad_(False)


def prediction_of(output):
    """The prediction in a net's output: a tensor, `.logits` (Hugging Face), or the first item."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    raise UserError(f"the net returned {type(output).__name__}: expected a tensor or `.logits`")


class ModuleTask(Task):
    """A net from `model.net` (a node with `_target_`), trained with `model.loss`.

    The dataset's target (`labels`, or a zoo dataset's `label`/`mask`) goes to the loss; the
    other fields go to the net, positionally when there is one, as keyword arguments otherwise.
    With `model.loss=output` the net also gets the target and returns its loss."""

    keyword_inputs = False  # Hugging Face models take every input by name

    def __init__(
        self,
        data: DataModule,
        net: Mapping | nn.Module,
        loss="cross_entropy",
        freeze: Sequence[str] = (),
        gradient_checkpointing: bool = False,
        channels_last: bool | None = None,
        peft: Mapping | None = None,
    ):
        super().__init__()
        if isinstance(net, nn.Module):
            self.net = net
        else:
            with building("model.net", net):
                self.net = instantiate(net)
            if not isinstance(self.net, nn.Module):
                raise UserError(
                    f"model.net._target_={net['_target_']} built a {type(self.net).__name__}, "
                    "not a torch.nn.Module"
                )
        self.loss: Loss = loss if isinstance(loss, Loss) else make_loss(loss)
        _, target = batch_target(data.collate("train", [(0, 0, 0)]))  # one item, to check
        self.loss.check(target)
        if isinstance(self.loss, NetOutput):
            console.say(
                "[yellow]note:[/] model.loss=output: the net averages its own loss over each "
                "micro-batch, so accumulation averages per micro-batch (exact when micro-batches "
                "hold equal numbers of targets)"
            )
        self.frozen = list(freeze)
        freeze_parameters(self.net, self.frozen)  # by the net's own names, before PEFT's wrap
        if peft is not None:  # model.peft: LoRA adapters train, the rest of the net is frozen
            self.net = adapters.add_lora(self.net, peft)
        if gradient_checkpointing:
            self._checkpoint_blocks()
        if channels_last is None:
            channels_last = any(isinstance(m, nn.Conv2d) for m in self.net.modules())
        self.channels_last = channels_last
        if channels_last:
            self.net.to(memory_format=torch.channels_last)
        self._probe(data, net)

    def _probe(self, data: DataModule, net) -> None:
        """The first items of the training data through the net and the loss, before training
        (in eval mode, without gradients): data the net cannot take, or targets beyond the
        classes it predicts, are one line here rather than a traceback in the first step."""
        n = min(PROBE_ITEMS, data.split_size("train"))
        batch = data.collate("train", [(0, 0, i) for i in range(n)])
        training, name = self.training, getattr(net, "get", lambda *_: None)("_target_")
        name = name or type(self.net).__name__
        # A net that holds some weights in bf16/fp16 itself runs under autocast, as it trains.
        low = {q.dtype for q in self.parameters()} & {torch.bfloat16, torch.float16}
        autocast = torch.autocast("cpu", dtype=min(low, key=str)) if low else nullcontext()
        self.eval()
        try:
            with torch.no_grad(), autocast:
                output, target = self._run(batch)
                prediction = self._prediction(output)
                if isinstance(self.loss, CrossEntropy):
                    self.loss.check_classes(prediction, target)
                self.loss.total(prediction, target)
        except UserError:
            raise
        except Exception as e:
            inputs = ", ".join(f"{k} {shape_of(v)}" for k, v in batch_target(batch)[0].items())
            raise UserError(
                f"model.net ({name}) cannot take the dataset's items (a batch of {n}: {inputs}): "
                f"{first_line(e)}"
            ) from None
        finally:
            self.train(training)

    def _checkpoint_blocks(self) -> None:
        units = blocks(self.net)
        if not units:
            raise UserError(
                "model.gradient_checkpointing=true: the net has no nn.ModuleList or "
                "nn.Sequential of blocks to recompute"
            )
        for block in units:
            recompute_in_backward(block)

    def shard_units(self) -> list[nn.Module]:
        return blocks(self.net)

    def output_head(self) -> nn.Module | None:
        """A Hugging Face net's `get_output_embeddings()` (a causal or masked LM's head); else
        the net's last `nn.Linear` in registration order (a single-file GPT's `lm_head`, a
        classifier's last layer). A head elsewhere: name it in precision.fp32_modules."""
        getter = getattr(self.net, "get_output_embeddings", None)
        head = getter() if callable(getter) else None
        if head is None:
            linears = [m for m in self.net.modules() if isinstance(m, nn.Linear)]
            head = linears[-1] if linears else None
        return head

    def inputs(self, batch: Batch) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        inputs, target = batch_target(batch)
        if self.channels_last:
            inputs = {
                k: v.contiguous(memory_format=torch.channels_last) if v.ndim == 4 else v
                for k, v in inputs.items()
            }
        return inputs, target

    def _run(self, batch: Batch):
        """(the net's output, the target)."""
        inputs, target = self.inputs(batch)
        give_target = self.loss.target_to_net and target is not None
        if len(inputs) == 1 and not self.keyword_inputs:
            args = [*inputs.values(), *([target] if give_target else [])]
            return self.net(*args), target
        return self.net(**inputs, **({"labels": target} if give_target else {})), target

    def _prediction(self, output):
        return output if isinstance(self.loss, NetOutput) else prediction_of(output)

    def forward(self, batch: Batch) -> torch.Tensor:
        output, target = self._run(batch)
        return self.loss.total(self._prediction(output), target)

    def num_targets(self, batch: Batch) -> int:
        return self.loss.count(batch_target(batch)[1])

    def num_tokens(self, batch: Batch) -> int:
        """Tokens for a language model (its throughput unit): `input_ids`, or class targets with a
        sequence dimension ([N, T], a single-file GPT's shifted ids); else samples."""
        if "input_ids" in batch:
            return batch["input_ids"].numel()
        target = batch_target(batch)[1]
        if target is not None and target.ndim == 2 and not target.is_floating_point():
            return target.numel()
        return len(next(iter(batch.values())))

    def eval_sums(self, batch: Batch) -> dict[str, torch.Tensor]:
        output, target = self._run(batch)
        prediction = self._prediction(output)
        if isinstance(self.loss, CrossEntropy):
            self.predicted(self.loss.align(prediction, target)[0])  # classes last
            return self.loss.eval_sums(prediction.float(), target)
        if isinstance(prediction, torch.Tensor) and not isinstance(self.loss, NetOutput):
            prediction = self.predicted(prediction, VALUES)
        return {"loss": self.loss.total(prediction, target)}

    def eval_metrics(self, totals: dict[str, float], count: int) -> dict[str, float]:
        metrics = {
            k: v / max(count, 1)
            for k, v in totals.items()
            if not k.startswith(("tp_", "fp_", "fn_"))
        }
        f1 = macro_f1(totals)
        return metrics if f1 is None else metrics | {"macro_f1": f1}

    def describe(self) -> dict:
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        return {"trainable_parameters": trainable, "frozen": self.frozen} | adapters.describe(
            self.net
        )
