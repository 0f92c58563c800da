"""The precision group's checks of a composed config (runner/config/validation.py's `validate` calls
them): the mode, a staged schedule, a converting mode's keys, the bf16 update rule, the kernel,
adapter and reduce dtypes, the gradient scaler, and the fp32 islands and norm modules. Each failure
is one UserError line naming the key, its value and what is allowed."""

from __future__ import annotations

from omegaconf import ListConfig

from runner.config.rules import number, require
from runner.config.schema import ADAPTER_DTYPES, BF16_UPDATES, CPU_KERNELS
from runner.precision import recipe
from runner.precision.modes import MODES, choices


def _validate_stages(stages) -> None:
    require(len(stages) > 0, "precision.stages", [], "precision=staged needs at least one stage")
    previous = 0
    for i, stage in enumerate(stages):
        key = f"precision.stages.{i}"
        require(
            stage.mode in choices(stage=True),
            f"{key}.mode",
            stage.mode,
            "allowed: " + ", ".join(choices(stage=True)),
        )
        if i == len(stages) - 1:
            require(
                stage.until_step is None,
                f"{key}.until_step",
                stage.until_step,
                "the last stage runs to the end: leave it null",
            )
        else:
            require(
                stage.until_step is not None and stage.until_step > previous,
                f"{key}.until_step",
                stage.until_step,
                f"must be a step after the previous stage's ({previous})",
            )
            previous = stage.until_step


def _validate_converting(p) -> None:
    """A converting mode (fp8, mxfp8, nvfp4, mxfp4): the precision.fp8 keys its format ignores
    are refused (mxfp8's: fp8's recipe and all-gather; the fp4 formats' all of them, they read
    precision.fp4); a staged run converts its Linears once, so to one format; precision.recipe
    needs one."""
    modes = {s.mode for s in p.stages} if p.mode == "staged" else {p.mode}
    formats = [MODES[m] for m in MODES if m in modes and MODES[m].converts]
    names = " stages or ".join(m.name for m in formats)
    why = f"a run converts its Linears once: {names} stages, not both"
    require(len(formats) <= 1, "precision.stages", [s.mode for s in p.stages], why)
    for key, unset, why in formats[0].ignored_fp8_keys if formats else ():
        require(p.fp8[key] == unset, f"precision.fp8.{key}", p.fp8[key], why)
    if p.get("recipe") is not None:
        converting = ", ".join(m for m in MODES if MODES[m].converts)
        why = f"a recipe chooses formats per Linear in a converting mode ({converting})"
        require(bool(formats), "precision.recipe", p.recipe, why)
        recipe.load(p.recipe, formats[0].compute, p.fp8.recipe)  # a bad file is one line


def _validate_precision(p, t) -> None:
    """The mode (and its refusal under FSDP), a staged schedule, a converting mode's keys, the
    bf16 update rule, CPU kernels, adapter and reduce dtypes, precision.fp8's kept blocks."""
    refusal = MODES[p.mode].fsdp_refusal if p.mode in MODES else None
    require(not (t.strategy == "fsdp" and refusal), "precision.mode", p.mode, refusal or "")
    require(
        p.mode in choices(),
        "precision.mode",
        p.mode,
        "allowed: " + ", ".join(choices()),
    )
    if p.mode == "staged":
        _validate_stages(p.stages)
    _validate_converting(p)
    update = p["update"]
    require(update in BF16_UPDATES, "precision.update", update, ", ".join(BF16_UPDATES))
    why = "applies to a mode that holds bf16 weights (precision=bf16_true) only"
    bf16_weights = p.mode in MODES and MODES[p.mode].weights == "bf16"
    require(update == "plain" or bf16_weights, "precision.update", update, why)
    require(
        p.cpu_kernels in CPU_KERNELS,
        "precision.cpu_kernels",
        p.cpu_kernels,
        "allowed: " + ", ".join(CPU_KERNELS),
    )
    require(
        p.adapter_dtype in ADAPTER_DTYPES,
        "precision.adapter_dtype",
        p.adapter_dtype,
        "allowed: " + ", ".join(ADAPTER_DTYPES),
    )
    require(
        p.reduce_dtype in ("fp32", "bf16"),
        "precision.reduce_dtype",
        p.reduce_dtype,
        "allowed: fp32, bf16",
    )
    for end in ("first", "last"):
        kept = p.fp8.keep_bf16[end]
        key = f"precision.fp8.keep_bf16.{end}"
        require(kept >= 0, key, kept, "a number of the model's blocks: must be ≥ 0")


def _validate_grad_scaler(gs) -> None:
    require(
        number(gs.init_scale) and gs.init_scale > 0,
        "precision.grad_scaler.init_scale",
        gs.init_scale,
        "must be a finite number > 0",
    )
    require(
        number(gs.growth_factor) and gs.growth_factor > 1,
        "precision.grad_scaler.growth_factor",
        gs.growth_factor,
        "must be a finite number > 1",
    )
    require(
        0 < gs.backoff_factor < 1,
        "precision.grad_scaler.backoff_factor",
        gs.backoff_factor,
        "must be between 0 and 1",
    )
    require(
        gs.growth_interval >= 1,
        "precision.grad_scaler.growth_interval",
        gs.growth_interval,
        "must be ≥ 1",
    )
    require(gs.hysteresis >= 1, "precision.grad_scaler.hysteresis", gs.hysteresis, "must be ≥ 1")
    # The floor and the cap hold init_scale between them, so the first step is inside already.
    floor, cap, init = gs.min_scale, gs.max_scale, gs.init_scale
    require(
        floor is None or (number(floor) and 0 < floor <= init),
        "precision.grad_scaler.min_scale",
        floor,
        f"must be null or a finite number > 0 and ≤ init_scale ({init:g})",
    )
    require(
        cap is None or (number(cap) and cap >= init),
        "precision.grad_scaler.max_scale",
        cap,
        f"must be null or a finite number ≥ init_scale ({init:g})",
    )


def _validate_modules(p) -> None:
    """precision.fp32_modules and precision.norm_modules: names or fnmatch patterns."""
    islands = p.fp32_modules
    require(
        islands == "auto" or isinstance(islands, ListConfig),
        "precision.fp32_modules",
        islands,
        "a list of module names or fnmatch patterns ([name, ...]), or auto (searched first)",
    )
    for pattern in [] if islands == "auto" else islands:
        require(
            isinstance(pattern, str) and pattern.strip() != "",
            "precision.fp32_modules",
            list(islands),
            "module names or fnmatch patterns, none empty (an empty name is the whole model)",
        )
    for pattern in p.norm_modules:
        require(
            pattern.strip() != "",
            "precision.norm_modules",
            list(p.norm_modules),
            "class names or fnmatch patterns of module names, none empty",
        )
