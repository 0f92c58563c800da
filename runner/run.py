"""`run(cfg)`: one training run from a composed config. Plain function: the CLI, tests and
notebooks call it; it leaves no global state behind for the next run in the same process."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from runner import console, folders
from runner.answers import island_search, max_batch
from runner.answers.inference import evaluate_precisions
from runner.build import build, seed_everything
from runner.config.validation import validate
from runner.errors import Preempted, UserError, first_line
from runner.measure import autopilot_report, manifest, truth
from runner.measure.flops import emulation_slowdown, utilisation
from runner.measure.gpus import gpu_names
from runner.measure.health import fp4_health, fp16_health
from runner.measure.manifest_table import report as report_manifest
from runner.measure.memory import reset_peak_memory, trainer_memory
from runner.precision import DeviceCaps, Precision, mode_of
from runner.precision.caps import resolve_device
from runner.precision.fp4 import Fp4Linears
from runner.summary_aliases import with_aliases
from runner.tracking import RunLog, finished_summary, open_tracker
from runner.train import checkpoint, distributed, preemption
from runner.train.optim import build_optimizers
from runner.train.threads import Threads
from runner.train.trainer import Trainer
from runner.train.wall_time import WallClock


def output_dir(explicit: str | Path | None) -> Path:
    if explicit is not None:
        return Path(explicit)
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path.cwd()


@preemption.handled  # signals caught from the first line to the last
def run(cfg: DictConfig, out_dir: str | Path | None = None) -> dict:
    """Train as `cfg` says; write metrics.jsonl, summary.json and checkpoints/ to the run
    directory; return the summary. A failed run still leaves a summary.json that says why."""
    clock = WallClock()  # where its wall time goes: summary.json's `wall_time`
    validate(cfg)
    ranks = distributed.init()
    console.console.quiet = not ranks.main  # one voice: rank 0's
    out = output_dir(out_dir)
    console.log_loader_noise()  # torchao's import noise, kept off the console, into <job>.log
    folders.claim(out, ranks.main)  # one writer: this process, until the run returns
    try:
        return _run(cfg, out, ranks, clock)
    finally:
        folders.release(out)


def _run(cfg: DictConfig, out: Path, ranks, clock: WallClock) -> dict:
    gpu_names(cfg.runner.project)  # an unknown GPU: one line before the run trains, not after
    resume = _resume_point(cfg, out)
    state = resume[1] if resume else None
    # a requeued job whose run had finished: its summary stands, and it ends at once
    finished = state is not None and state["step"] >= cfg.trainer.max_steps
    done = finished_summary(out, state["step"]) if finished else None
    # the command's values held against the run the folder holds, before anything is written
    run_id = folders.admit(out, cfg, resume, done is not None, ranks)
    if done is not None:
        console.say(
            f"{resume[0]} is at step {state['step']}: the run had finished "
            f"(trainer.max_steps={cfg.trainer.max_steps}); its summary.json stands"
        )
        if ranks.main:
            console.summary_table(done, cfg.runner.summary, out / "summary.json")
        return done
    log = RunLog(
        out,
        open_tracker(cfg, out, run_id) if ranks.main else None,
        resume_step=state["step"] if state else None,
        write=ranks.main,
    )
    summary: dict = {"status": "running"}
    precision = trainer = None
    threads = Threads()  # what other processes take of the cores is read from here
    try:
        signals = preemption.setup_begins()  # from here to training: a signal stops it at once
        device = distributed.device_for(ranks, resolve_device(cfg.trainer.device))
        caps = DeviceCaps.probe(device)
        precision = _precision(cfg, device, caps, ranks)
        summary |= _device_facts(precision, device, caps)
        summary |= threads.fit(cfg.trainer.cpu_threads, device)
        with clock.part("answers_before_training"):
            summary |= _before_training(cfg, out, state, device, ranks)
        with clock.part("build"):
            trainer, plan = _trainer(cfg, precision, device, ranks, log, summary)
        if state is not None:
            trainer.load_state_dict(state)
            console.say(f"resumed from {resume[0]} at step {trainer.step}")
        summary |= _describe(trainer, ranks, cfg)
        plan.started()
        summary |= trainer.fit(signals)
        summary |= _measurements(cfg, trainer, precision, caps, summary)
        summary |= _after_training(cfg, trainer, precision, plan, log, ranks, summary)
        summary["status"] = "completed"
        summary["wall_time"] = clock.breakdown(trainer.meter)
    except BaseException as e:
        status, code = {
            KeyboardInterrupt: ("interrupted", 130),
            Preempted: ("preempted", Preempted.exit_code),
        }.get(type(e), ("failed", 1))
        summary |= {"status": status, "error": first_line(e)}
        if trainer is not None:
            summary["steps"] = trainer.step
        summary["wall_time"] = clock.breakdown(trainer and trainer.meter)  # to its stop
        log.finish(summary, exit_code=code)
        raise
    finally:
        threads.restore()
        if precision is not None:
            precision.close()
    log.finish(summary)
    if ranks.main:
        console.summary_table(summary, cfg.runner.summary, out / "summary.json")
    return summary


def _resume_point(cfg: DictConfig, out: Path) -> tuple | None:
    """The checkpoint to resume from, (path, state), or None; an earlier run's record in `out`
    without trainer.resume is refused: a fresh start would empty it, and a failed build would
    leave nothing in its place."""
    record = out / "metrics.jsonl"
    if not cfg.trainer.resume and record.exists() and record.stat().st_size:
        if _in_sweep():
            # A sweep run again in its folder (the same hydra.sweep.dir), to complete it: a job
            # that had completed is read back (`_finished`, which refuses a changed command),
            # one that had stopped continues from its last checkpoint.
            return checkpoint.find_resume("auto", out)
        raise UserError(
            f"{out} holds an earlier run's metrics.jsonl: continue it with trainer.resume=auto, "
            "or give this run a folder of its own (hydra.run.dir=...)"
        )
    return checkpoint.find_resume(cfg.trainer.resume, out)


def _in_sweep() -> bool:
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _precision(cfg: DictConfig, device: torch.device, caps: DeviceCaps, ranks) -> Precision:
    """The run's Precision, announced with its warnings, and where the CPU emulates a mode's
    matmuls with PyTorch's own kernels, how much slower they run (measured)."""
    sharded = ranks.enabled and cfg.trainer.strategy == "fsdp"
    precision = Precision(cfg.precision, device, caps, sharded=sharded, world=ranks.world)
    console.say(f"precision: {precision.describe()}")
    for warning in precision.warnings:
        console.say(f"[yellow]warning:[/] {warning}")
    for note in precision.kernel_notes():
        console.say(note)
    for _, mode, _ in precision.stages:
        if precision.emulates(mode):
            continue
        factor = emulation_slowdown(caps, mode_of(mode), Path(cfg.cache_dir).expanduser())
        if factor:
            console.say(
                f"[yellow]warning:[/] {mode} matmuls run {factor:.0f}× slower than fp32 on "
                f"this CPU (measured), so its speed figures mean little here; "
                f"precision=auto picks {caps.best_mode()[0]} on this machine"
            )
    return precision


def _device_facts(precision: Precision, device: torch.device, caps: DeviceCaps) -> dict:
    return {
        "precision": precision.name,
        "precision_requested": precision.requested,
        "precision_reason": precision.reason,
        "device": str(device),
        "device_name": caps.name,
        "torch_version": torch.__version__,
    }


def _before_training(cfg: DictConfig, out: Path, state, device, ranks) -> dict:
    """The answers found by throwaway runs before training: the fp32 islands
    (precision.fp32_modules=auto; training keeps them) and the largest batch."""
    found: dict = {}
    if cfg.precision.fp32_modules == "auto":
        found["fp32_islands"] = island_search.before_training(cfg, out, state, ranks.enabled)
    if cfg.runner.max_batch:  # with the islands found; training as configured
        found |= max_batch.search(cfg, device, ranks.world)
    return found


def _trainer(cfg: DictConfig, precision: Precision, device, ranks, log: RunLog, summary: dict):
    """The task built and prepared (islands, the mode's conversions, compile, DDP/FSDP), its
    optimizers, and the Trainer; with the precision manifest's plan, read before anything
    converts. Returns (trainer, plan)."""
    seed_everything(cfg.seed)
    with distributed.main_first(ranks):
        data, task = build(cfg)
    task.to(device)
    if ranks.enabled:  # the same initial weights everywhere; dropout differs by rank
        seed_everything(cfg.seed + ranks.rank)
    plan = manifest.Plan(task, precision)  # what the config asked, before anything converts
    precision.prepare(task, cfg.precision.fp32_modules)  # islands; fp16_master's masters
    summary["fp32_head"] = precision.fp32_head  # precision.fp32_head's module (None: off)
    if cfg.trainer.compile:
        task.compile()  # in place: parameter names and checkpoints stay as in eager mode
    reset_peak_memory(device)
    model = distributed.wrap(task, ranks, cfg.trainer.strategy, precision, device)
    groups = precision.optimizer_groups(task.parameter_groups())
    optimizers, schedulers = build_optimizers(cfg.optim, groups, cfg.trainer.max_steps)
    state_dtype = cfg.optim.get("state_dtype")
    truth.watch(optimizers, task, model, precision, state_dtype, summary)  # dtypes held
    trainer = Trainer(
        cfg.trainer, task, data, precision, optimizers, schedulers, log, device, ranks, model
    )
    trainer.extra_state = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "wandb_run_id": log.tracker.run_id if log.tracker else None,
    }
    return trainer, plan


def _describe(trainer: Trainer, ranks, cfg: DictConfig) -> dict:
    task = trainer.task
    return {
        "task": type(task).__name__,
        "parameters": sum(p.numel() for p in task.parameters()),
        **task.describe(),
        "batch_size": trainer.data.batch_size * ranks.world,  # the global batch
        "world_size": ranks.world,
        "accumulate_grad_batches": cfg.trainer.accumulate_grad_batches,
    }


def _measurements(cfg: DictConfig, trainer: Trainer, precision: Precision, caps, summary) -> dict:
    """What the fit measured beyond its own summary: CPU kernels, memory by category, fp16
    health, MFU, and a converting mode's converted Linears with their FLOP share (summary.json's
    `converted`, also under its old name `fp8`: runner/summary_aliases.py)."""
    found: dict = {"cpu_kernels": precision.cpu_kernels}
    found |= precision.memory(trainer.task)
    found["memory"] = trainer_memory(trainer)
    health = fp16_health(
        trainer.meter.health,
        trainer.meter.rows,
        cfg.precision.grad_scaler,
        (mode for _, mode, _ in precision.stages),
    )
    if health:
        found["fp16_health"] = health
        console.say(f"fp16 health: {health['recommendation']}")
    found |= utilisation(
        summary | found, caps, precision.peak_mode, Path(cfg.cache_dir).expanduser()
    )
    if "above_peak" in found:
        console.say(f"[yellow]warning:[/] {found['peak_note']}")
    if converted := precision.converted:
        low, flops = summary.pop("converted_flops_per_step", None), summary.get("flops_per_step")
        native = caps.type == "cuda" and caps.support(converted.compute)[0]  # fp4: never
        found["converted"] = converted.report() | {
            "kernels": "native" if native else "emulated",  # emulated: the numerics, not the speed
            "converted_flops_per_step": low,
            "converted_flop_share": low / flops if low and flops else None,
        }
        if isinstance(converted, Fp4Linears):  # the blocks every FP4 GEMM quantized
            found["converted"]["fp4_health"] = fp4_health(converted.recipe.counts, converted.fmt)
    return with_aliases(found)


def _after_training(cfg, trainer: Trainer, precision, plan, log, ranks, summary: dict) -> dict:
    """The final weights in each precision of runner.eval_precisions (rank 0), the precision
    manifest held against the plan, and the projection onto GPUs (runner.project)."""
    found: dict = {}
    evaluated: dict = {}  # the fp32 evaluation's first batch, as the manifest records it
    if ranks.main:
        masters = precision.master.masters  # fp16_master: the weights are these
        found |= evaluate_precisions(
            trainer.evaluation, cfg.runner.eval_precisions, masters, evaluated
        )
    truth_rows = getattr(summary.get("precision_truth"), "parameters", None)
    held = manifest.build(trainer.meter.audited_steps, plan, truth_rows, evaluated)
    found |= {"precision_manifest": held, "plan_held": held["plan_held"]}
    report_manifest(held, log)
    found |= trainer.errors.report(log)  # each matmul's error: summary.json's, the tracker's
    if ranks.main:  # what precision.autopilot did, and the recipe it ended with
        found |= autopilot_report.report(trainer, precision, log)
    if cfg.runner.project and ranks.main:  # estimates for GPUs it did not run on (issue 33)
        from runner.answers.projection import projection_for_run, show

        found["projection"] = projection_for_run(cfg, summary | found, trainer.meter)
        show(found["projection"])
    return found
