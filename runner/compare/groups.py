"""A comparison's rows: the jobs of one precision in one setting, one per seed (`Group`), and each
row's own figures over its seeds (the losses' mean ± std, a typical seed's median for the rest,
its speed from the interleaved timing where there is one). verdicts.py judges them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runner.compare import capacity
from runner.compare.stats import finite, mean_std, median, quartiles
from runner.measure.error_table import worst_layer
from runner.summary_aliases import converted_section

if TYPE_CHECKING:
    from runner.compare.jobs import Job

UNSTABLE = ("failed", "diverged", "overflow")  # job health that counts toward divergence_rate
PAIRED = ("speedup", "memory_saving", "max_loss_gap", "final_loss_gap", "health")
SPEED = ("samples_per_s", "samples_per_s_iqr", "samples_per_s_rounds", "step_time_s")


@dataclass(eq=False)
class Group:
    """The jobs of one row (a precision and everything else it ran), one per seed."""

    jobs: list[Job]
    label: str
    verdict: str = ""
    figures: dict = field(default_factory=dict)
    base: Group | None = None  # what it is compared with (runner/compare/sweep.py's `baseline`)

    @property
    def precision(self) -> str:
        return self.jobs[0].precision

    @property
    def identity(self) -> tuple:
        return self.jobs[0].identity

    @property
    def setting(self) -> tuple:
        return self.jobs[0].setting

    @property
    def key(self) -> tuple:
        """The row's identity, as the interleaved timings are keyed."""
        return (self.precision, self.identity)

    @property
    def status(self) -> str:
        """ "completed", or the status of its first seed that did not complete."""
        statuses = (j.summary.get("status") for j in self.jobs)
        return next((s for s in statuses if s != "completed"), "completed")

    @property
    def unstable(self) -> list[Job]:
        return [j for j in self.jobs if j.figures["health"] in UNSTABLE]

    @property
    def counted(self) -> list[Job]:
        """The seeds its figures come from: those that neither failed nor diverged, else all."""
        return [j for j in self.jobs if j.figures["health"] not in UNSTABLE] or self.jobs


def completed(row: Group) -> bool:
    return any(j.summary.get("status") == "completed" for j in row.jobs)


def closest(row: Group, candidates: list[Group]) -> Group:
    """Of `candidates`, the row that shares the most of `row`'s precision.* values (fp32
    init_scale=1 for fp16 init_scale=1)."""
    return max(candidates, key=lambda p: len(set(p.identity) & set(row.identity)))


def scales_loss(precision: str) -> bool:
    """Whether a row's mode scales its loss (fp16, fp16_master): a skip there is an overflow."""
    from runner.precision.modes import MODES

    return precision in MODES and MODES[precision].scales_loss


def memory_figure(summary: dict) -> tuple[float, str]:
    """(MB, what it is) for the memory saving: CUDA's measured peak; on a CPU the accounted total
    of summary.json's `memory` (a CPU process's peak is not one job's: a sweep's later jobs
    inherit it); for a summary from before that accounting, the process's peak."""
    memory = summary.get("memory") or {}
    if memory.get("peak") is not None:
        return float(memory["peak"]), "measured peak"
    if memory.get("total") is not None:
        return float(memory["total"]), "accounted total"
    peak = summary.get("peak_memory_mb")
    return (math.nan if peak is None else float(peak)), "process peak"


def plan_held(g: Group) -> dict:
    """Whether the precision plan held in every seed (summary.json's `plan_held`: False where
    one seed's did not, None, untested, where a seed has no such key), and the first mismatch
    of the first seed where it did not (its `precision_manifest`)."""
    held = [j.summary.get("plan_held") for j in g.jobs]
    broken = next((j.summary for j in g.jobs if j.summary.get("plan_held") is False), None)
    manifest = (broken or {}).get("precision_manifest")
    mismatches = (manifest.get("mismatches") if isinstance(manifest, dict) else None) or [None]
    return {
        "plan_held": False if broken else (True if all(h is True for h in held) else None),
        "plan_mismatch": mismatches[0],
    }


def _emulated_by(summary: dict) -> str | None:
    """What makes a job's speed say nothing of its precision's: "nothing converted" where its
    converting mode (fp8, mxfp8, nvfp4, mxfp4) converted no Linear; "converted" where its
    converted Linears' GEMMs were emulated (fp8 and mxfp8 without their units, nvfp4 and mxfp4
    always), "cpu_kernels" where precision.cpu_kernels=fast computed its low-precision matmuls in
    fp32; else None."""
    converted = converted_section(summary)  # an older run's: its `fp8`
    if converted.get("nothing_converted"):  # it ran as bf16: says nothing of it
        return "nothing converted"
    if converted.get("kernels") == "emulated":
        return "converted"
    return "cpu_kernels" if summary.get("cpu_kernels") == "fast" else None


def own_figures(g: Group, timing: dict | None, first: frozenset | None = None) -> dict:
    """Its figures over its seeds (its speed, memory and the rest but the losses over those
    of `first`, a runner.seeds=auto sweep's first look, where it has any: later seeds cannot
    move them); its speed from `timing` where it was timed interleaved."""
    jobs = g.counted
    typical = [j for j in jobs if first is None or j.config.get("seed") in first] or jobs
    f = {k: median(j.figures[k] for j in typical) for k in jobs[0].figures if k not in PAIRED}
    for key in ("final_loss", "eval_loss"):
        f[key], f[f"{key}_std"] = mean_std(j.figures[key] for j in jobs)
    f |= {"samples_per_s_rounds": None, "speed_source": "jobs"}
    f["memory_source"] = memory_figure(jobs[0].summary)[1]
    f |= capacity.own(g, f["max_batch"])  # how its max batch was found
    f["speed_emulated_by"] = next(filter(None, (_emulated_by(j.summary) for j in g.jobs)), None)
    f["speed_emulated"] = f["speed_emulated_by"] is not None
    # A seed timed while another process held its cores: the row's speed is untested (of
    # the seeds its speed comes from: an auto sweep's first look's)
    timed = [j for j in g.jobs if first is None or j.config.get("seed") in first] or g.jobs
    shared = next((j.summary for j in timed if j.summary.get("speed_contended")), None)
    f["speed_contended"] = shared is not None
    f["contention"] = ((shared or {}).get("contention") or {}).get("words")
    if timing is not None:
        f |= {k: timing[k] for k in SPEED} | {"speed_source": "interleaved"}
        f["speed_contended"] = bool(timing.get("speed_contended"))
        f["contention"] = timing.get("contention")
        f["samples_per_s_q1"], f["samples_per_s_q3"] = quartiles(timing["samples_per_s_rounds"])
        # Its MFU by the step time its speed now comes from (as runner/measure/flops.py's utilisation;
        # over 1, the peak is no ceiling, and no MFU is shown), neither from a contended timing
        # nor against a peak measured while other processes held the cores.
        mfu = f["flops_per_step"] / f["step_time_s"] / (f["peak_tflops"] * 1e12)
        shared = f["speed_contended"] or any(j.summary.get("peak_contended") for j in jobs)
        f["mfu"] = mfu if mfu <= 1 and not shared else math.nan
    return (
        f
        | plan_held(g)
        | {"worst_layer": worst_layer([j.summary for j in jobs])}  # lowest matmul SQNR
        | {
            "eval_loss_mean": f["eval_loss"],
            "seeds": len(g.jobs),
            "divergence_rate": len(g.unstable) / len(g.jobs),
            # Against the baseline's job of the same seed: the worst seed's curve gap, a typical
            # final gap.
            "max_loss_gap": max(
                finite(j.figures.get("max_loss_gap") for j in jobs), default=math.nan
            ),
            "final_loss_gap": median(j.figures.get("final_loss_gap") for j in jobs),
        }
    )


# A row timed while another process held its cores (`speed_contended`): its own speed cells say
# so, and its ratios to the baseline (or every row's, where the baseline's was) are untested
OWN_SPEED = ("samples_per_s", "samples_per_s_iqr", "time_to_target_s")
SPEED_RATIOS = ("speedup", "time_to_target_speedup")


def contended(group: Group, key: str) -> bool:
    """Whether `key`'s figure of `group` was timed contended: its own speed, or for a ratio to
    the baseline, either side's."""
    shared = bool(group.figures.get("speed_contended"))
    if key in SPEED_RATIOS:
        base = group.base
        return (
            base is not None
            and base is not group
            and (shared or bool(base.figures.get("speed_contended")))
        )
    return key in OWN_SPEED and shared
