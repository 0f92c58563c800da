"""The fp32 islands a model needs (`python -m runner.islands`, `precision.fp32_modules=auto`): a
small set of modules to keep in fp32 that makes a model train in the precision asked for, or the
word that no small set exists.

A trial is a short run (the first `runner.islands_steps` optimizer steps of the configured run,
on its LR schedule, as runner/answers/trials.py runs it) in one process. It trains as the fp32 baseline does (`fault`) when, after the
scaler's first calibration (the skipped steps at the start while the loss scale backs off from
init_scale), at most MAX_SKIPPED_SHARE of its steps are skipped, no loss is non-finite, and its
mean loss over those steps is within LOSS_TOLERANCE of an fp32 run's over the same steps. Where it
does not, the failing window is its first non-finite loss, else its first skipped step once the
scale had settled: the trainer's forensics (nonfinite.json) name the first module whose output, or
incoming gradient, became non-finite there; that module is kept in fp32 and the window replayed
(runner/train/diagnostics.py) on the weights it saw, at the loss scale the run settled at, until
it runs finite; then a run with the set is judged again. A trial whose fault is its loss alone has
no window to replay: no small set. At most `runner.islands_max` modules.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from runner import console
from runner.answers.island_criteria import culprit, fp32_share, loss_fault, range_fault
from runner.answers.trials import Trials
from runner.errors import UserError
from runner.files import write_text
from runner.precision import Precision, mode_of
from runner.precision.caps import resolve_device
from runner.tracking import dumps
from runner.train.diagnostics import found_something, replay
from runner.train.trainer import Trainer

RESULT_FILE = "islands.json"


class Search(Trials):
    """One config's search: its trials (runner/answers/trials.py) and the replays of their
    failing windows."""

    def __init__(self, cfg: DictConfig, out: Path):
        precision = Precision(cfg.precision, resolve_device(cfg.trainer.device))
        precision.close()
        self.stages = [m for _, m, _ in precision.stages]  # auto and staged resolved
        if all(mode_of(m).low_dtype is None and not mode_of(m).converts for m in self.stages):
            raise UserError(
                f"the fp32 islands search needs a low-precision mode: precision={cfg.precision.mode}"
                " computes in fp32 already (use e.g. precision=fp16 or bf16)"
            )
        super().__init__(cfg, out, cfg.runner.islands_steps)
        self._reference: tuple[dict, list[dict]] | None = None

    def reference(self) -> tuple[dict, list[dict]]:
        """The fp32 run of the same steps (run once): its summary and metrics."""
        if self._reference is None:
            summary, trainer = self.fit([], mode="fp32", stages=[])
            self._reference = summary, trainer.meter.rows
        return self._reference

    def attempt(self, islands: list[str]) -> tuple[dict, Trainer, tuple[str, int | None] | None]:
        """A run with `islands` in the precision asked for: its summary, its trainer, and why it
        does not train as fp32 does with the step to replay for it (None: no step is at fault);
        None where it does."""
        summary, trainer = self.fit(islands)
        record, rows = self.trials[-1], trainer.meter.rows
        fault: tuple[str, int | None] | None = range_fault(rows)
        if fault and "stopped" in summary:
            fault = summary["stopped"], fault[1]
        if fault is None and (why := loss_fault(rows, self.reference()[1])):
            fault = why, None
        record["trains"] = fault is None
        if fault:
            record["fault"] = fault[0]
        return summary, trainer, fault

    def window(self, step: int) -> list[dict]:
        """The micro-batches of optimizer step `step` (the stream's batches are all full)."""
        k = self.cfg.trainer.accumulate_grad_batches
        batches = iter(self.data.train_loader((step - 1) * self.data.batch_size * k))
        return [next(batches) for _ in range(k)]

    def replay(self, weights: dict, islands: list[str], step: int, loss_scale: float) -> dict:
        """Step `step`'s window forward and backward again on `weights` with `islands` kept in
        fp32, at `loss_scale`: the forensics' report."""
        task = self.task(weights).to(self.device)
        precision, _ = self.precision(task, islands)
        try:
            precision.at_step(step - 1)  # a staged run: the stage of that step
            window = self.window(step)
            norm = sum(task.num_targets(b) for b in window)
            with precision.fast_kernels:
                report = replay(
                    task,
                    precision,
                    window,
                    lambda b: {k: v.to(self.device) for k, v in b.items()},
                    loss_scale / norm,
                    loss_scale,
                )
        finally:
            precision.close()
        self.trials.append(
            {
                "kind": "replay",
                "step": step,
                "fp32_modules": list(islands),
                "finite": not found_something(report),
                "first_nonfinite": culprit(report),
            }
        )
        return report

    def grow(self, islands: list[str], trainer: Trainer, step: int) -> str | None:
        """After a trial that failed at `step`: modules added to `islands` until that window
        replays finite. Returns why no small set exists, or None when the window now runs finite."""
        rows = trainer.meter.rows
        # The lowest scale the scaler reached from that step on (a forward's overflow is the
        # same at any; a gradient that overflows even there is the module's range, not the scale)
        loss_scale = float(min(r["loss_scale"] for r in rows[step - 1 :]))
        # Skipped steps change no weight: those the failing step saw are the initial ones where
        # no step was applied before it, the task's where none was after it, else a run to it's.
        if all(r["skipped"] for r in rows[: step - 1]):
            weights = self.initial
        else:
            if not all(r["skipped"] for r in rows[step - 1 :]):
                _, trainer = self.fit(islands, steps=step)
                self.trials[-1] |= {"kind": "rerun", "trains": False, "for_step": step}
            weights = {k: v.detach().clone() for k, v in trainer.task.state_dict().items()}
        forensics = trainer.forensics.report
        if forensics and forensics["step"] == step:
            report = forensics  # nonfinite.json: the failing step, as the run replayed it
        else:
            report = self.replay(weights, islands, step, loss_scale)
        if not found_something(report):
            return f"step {step} replays finite: no module's range is at fault"
        while found_something(report):
            module = culprit(report)
            if module is None:
                return f"step {step} has non-finite gradients in no module's output"
            if module in islands:
                return f"{module} is non-finite at step {step} even in fp32"
            if len(islands) >= self.cfg.runner.islands_max:
                return (
                    f"{len(islands)} modules kept in fp32 (runner.islands_max) and {module} "
                    f"is still non-finite at step {step}"
                )
            islands.append(module)
            report = self.replay(weights, islands, step, loss_scale)
        return None


def percent(share: float | None) -> str:
    return "?" if share is None else f"{share:.1%}"


def _advice(stages: list[str]) -> str:
    """What to train in instead: bf16 (fp32's range) where fp16 overflows, else fp32."""
    return "bf16" if any(mode_of(m).low_dtype == torch.float16 for m in stages) else "fp32"


def search(cfg: DictConfig, out: Path) -> dict:
    """The islands for `cfg` (its `precision.fp32_modules` list, if any, the starting set): the
    trials in `out/trial-N/`, the result returned and written to `out/islands.json`."""
    s = Search(cfg, out)
    start = cfg.precision.fp32_modules
    islands = [] if start == "auto" else list(start)
    summary, trainer, fault = s.attempt(islands)
    why = None
    while fault:
        problem, step = fault
        if step is None:
            why = f"{problem}, with no step's range at fault"
            break
        console.say(f"islands: {problem}; replaying step {step}")
        if why := s.grow(islands, trainer, step):
            break
        summary, trainer, fault = s.attempt(islands)
    name = trainer.precision.name
    result = {
        "precision": name,
        "steps": s.steps,
        "found": why is None,
        "fp32_modules": islands,
        "trials": s.trials,
    }
    if why is None:
        reference, _ = s.reference()
        share, loss, fp32_loss = fp32_share(summary), summary["final_loss"], reference["final_loss"]
        line = f"precision.fp32_modules=[{','.join(islands)}]"
        result |= {
            "config": line,
            "fp32_flop_share": share,
            "final_loss": loss,
            "fp32_final_loss": fp32_loss,
            "loss_gap": loss - fp32_loss,
            "verdict": (
                f"keep {', '.join(islands)} in fp32: {line}"
                if islands
                else f"{name} trains as is: no fp32 islands needed"
            )
            + f" ({percent(share)} of the FLOPs in fp32; loss after {summary['steps']} steps "
            f"{loss:.4g}, fp32's {fp32_loss:.4g})",
        }
    else:
        result["verdict"] = f"no small set: use {_advice(s.stages)} ({why})"
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / RESULT_FILE, dumps(result, indent=2) + "\n")
    return result


def before_training(cfg: DictConfig, out: Path, state: dict | None, several_ranks: bool) -> dict:
    """`precision.fp32_modules=auto`: the islands searched for in `out/islands/` (a resumed run:
    those its checkpoint's run found), set into `cfg` for training; the summary's record of them.
    No small set is one error line."""
    saved = (state or {}).get("config", {}).get("precision", {}).get("fp32_modules")
    if isinstance(saved, list):
        cfg.precision.fp32_modules = saved
        return {"fp32_modules": saved, "found": True, "from": "checkpoint"}
    if several_ranks:
        raise UserError(
            "precision.fp32_modules=auto searches in one process: run python -m runner.islands "
            "with the same overrides, then train with the precision.fp32_modules=[...] it prints"
        )
    result = search(cfg, out / "islands")
    if not result["found"]:
        raise UserError(f"precision.fp32_modules=auto: {result['verdict']}")
    cfg.precision.fp32_modules = result["fp32_modules"]
    return {k: v for k, v in result.items() if k != "trials"}
