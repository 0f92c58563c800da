"""The recipe search's words (runner/answers/recipe_search.py): a candidate's outcomes, the
verdict line, and recipe.yaml's comments."""

from __future__ import annotations

from runner.answers.island_search import percent

PASSES, FAILS, NOISE = "passes", "fails", "within noise"


def _noise(result: dict) -> str:
    noise = result["noise"]
    if noise["spread"] is None:
        one = len(noise["seeds"]) == 1
        why = "one seed, runner.recipe_seeds=1" if one else "candidate 0 ended non-finite"
        return f"the noise is not measured: {why}"
    return f"candidate 0's gap spread {noise['spread']:.2%} over seeds {_ks(noise['seeds'])}"


def verdict(result: dict, found: dict | None) -> str:
    """The search's answer in one line: the recipe, or that its runs cannot tell, or that no
    small set passes; with the noise it judged against."""
    mode, tolerance = result["precision"], pct(result["tolerance"])
    candidates = result["candidates"]
    unsure = [c["k"] for c in candidates if c["outcome"] == NOISE]
    if found:
        kept = ", ".join(found["kept_bf16"]) or "nothing"
        gaps = ", ".join(f"{g:+.2%}" for g in found["loss_gaps"].values())
        line = (
            f"{mode} trains within {tolerance} of bf16 keeping {kept} in bf16 "
            f"({percent(found['converted_flop_share'])} of the FLOPs in {mode}; loss gap "
            f"{gaps} by seed; {_noise(result)}): precision.recipe={result['recipe']}"
        )
        if unsure:
            line += (
                f" (candidate(s) {_ks(unsure)} within noise of the tolerance: a smaller set may "
                "do as well)"
            )
        return line
    if unsure:
        return (
            f"cannot tell: {mode} candidate(s) {_ks(unsure)} end within the noise of the "
            f"{tolerance} tolerance ({_noise(result)}) and none passes on every seed: no recipe "
            "written (longer runs, runner.recipe_steps, or a tolerance wider than the noise "
            "decide it)"
        )
    return (
        f"no small set: {mode} stays more than {tolerance} from bf16's loss with up to "
        f"{len(candidates) - 1} unit(s) kept in bf16 (runner.recipe_max="
        f"{result['recipe_max']}, {len(result['ranked'])} ranked; {_noise(result)})"
    )


def _ks(ks: list[int]) -> str:
    return ", ".join(map(str, ks))


def pct(tolerance: float) -> str:
    return f"{100 * tolerance:g}%"  # 2%, 0.5%


def header(result: dict) -> str:
    """recipe.yaml's comments: how it was found, each candidate's gaps, outcome, share, speed."""
    lines = [
        f"# precision={result['precision']}: found by python -m runner.recipe, {result['steps']} "
        f"steps a run, tolerance {pct(result['tolerance'])} of bf16's mean loss over the last "
        f"{result['tail_share']:.0%} of the steps on each seed ({_noise(result)}); apply with the "
        "same overrides and precision.recipe=THIS_FILE",
    ]
    for c in result["candidates"]:
        speed = ", ".join(f"{gpu} {_x(p['speedup_vs_bf16'])}" for gpu, p in c["projected"].items())
        gaps = ", ".join(f"{g:+.2%}" for g in c["loss_gaps"].values())
        lines.append(
            f"# candidate {c['k']} ({c['outcome']}): kept in bf16: "
            f"{', '.join(c['kept_bf16']) or 'nothing'}; loss gap {gaps}; "
            f"{percent(c['converted_flop_share'])} of FLOPs in {result['precision']}; "
            f"projected vs bf16 (estimate): {speed}"
        )
    return "\n".join(lines) + "\n"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
