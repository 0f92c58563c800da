"""`runner.seeds=auto`: seeds added until every row's verdict is decided.

The sweep runs AUTO_SEEDS seeds of every job, then compares. A row is undecided where an
interval its verdict rests on still holds the boundary it is judged against: the loss gap's
reaches past the tolerance, or the time to target's holds 1 (`figures["undecided"]`, set by
runner/compare/verdicts.py). Each undecided row below runner.max_seeds, with its baseline, runs
one more seed, and the comparison looks again; it stops where every row is decided or has
reached the cap. A seed that diverges or never reaches the target counts as such (the row is
then decided: not recommended), never dropped.

Looking at the data before deciding whether to go on makes a 95% interval at each look cover
less than 95% over the whole sweep. The looks are at most max_seeds − AUTO_SEEDS + 1, known
before the first one, so every interval of such a sweep is taken at 1 − 5%/looks (an alpha
split, Bonferroni's): whatever the data do and whenever the sweep stops, the chance that any
interval it printed misses its truth is at most 5%. It costs width (99% for 6 seeds against
95%), but it holds for every stopping rule and needs nothing the t intervals do not already
assume; a confidence sequence would be narrower late but wider early, where sweeps stop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.compare.stats import CONFIDENCE
from runner.config.commandline import ROUND
from runner.config.schema import AUTO_SEEDS

if TYPE_CHECKING:
    from runner.compare.groups import Group
    from runner.config import RunnerConfig


def looks(max_seeds: int) -> int:
    """The comparisons an auto sweep may make: after AUTO_SEEDS seeds, then after each more."""
    return max(1, max_seeds - AUTO_SEEDS + 1)


def level(settings: RunnerConfig) -> float:
    """The confidence of every interval of the sweep: 95%, split over the looks where auto."""
    if settings.seeds != "auto":
        return CONFIDENCE
    return 1 - (1 - CONFIDENCE) / looks(settings.max_seeds)


def stopped(groups: list[Group], settings: RunnerConfig) -> None:
    """Each row's `seeds_stopped` (why it has the seeds it has, in words) in an auto sweep, and
    `more_seeds`: whether it runs one more (the undecided below the cap, and their baselines)."""
    if settings.seeds != "auto":
        return
    cap = settings.max_seeds
    more = [g for g in groups if g.figures.get("undecided") and len(g.jobs) < cap]
    bases = {g.base for g in more if g.base is not None}
    for g in groups:
        f = g.figures
        if f.get("undecided"):
            open_ = f"its {f['undecided']} interval still open"
            f["seeds_stopped"] = (
                f"undecided: {open_}; one more seed follows"
                if g in more
                else f"the cap, runner.max_seeds={cap}: {open_}"
            )
        elif g in bases:
            f["seeds_stopped"] = "the baseline of undecided rows; one more seed follows"
        else:
            f["seeds_stopped"] = "the baseline" if g.base in (None, g) else "decided"
    for g in groups:
        g.figures["more_seeds"] = g in more or g in bases


def next_round(groups: list[Group], ran: set[int]) -> tuple[int, dict[str, set[str]]] | None:
    """The next round of an auto sweep, None where it is done: its seed and, by key, the values
    to which runner/config/commandline.py's seed_round narrows the sweep. First, a later round
    that this process has not run (`ran`) and some of whose jobs did not complete (a sweep run
    again to complete it): the same jobs again (the values its own jobs set), so the completed
    ones are read back and the rest run. Else one past the sweep's last seed, for the rows that
    go on (`more_seeds`) and the values their jobs set on their command lines."""
    jobs = [j for g in groups for j in g.jobs]
    rounds: dict[int, list] = {}  # the later rounds' jobs, by seed
    for j in jobs:
        seed = j.config.get("seed")
        if j.folder.name.startswith(ROUND.format(seed=seed)):
            rounds.setdefault(seed, []).append(j)
    unfinished = {
        seed
        for seed, members in rounds.items()
        if any(j.summary.get("status") != "completed" for j in members)
    }
    if again := sorted(unfinished - ran):
        return again[0], _keep(rounds[again[0]])
    rows = [g for g in groups if g.figures.get("more_seeds")]
    if not rows:
        return None
    seed = 1 + max(j.config.get("seed", 0) for j in jobs)
    return seed, _keep([j for g in rows for j in g.jobs])


def _keep(jobs: list) -> dict[str, set[str]]:
    """By key, the values `jobs` set on their command lines (their overrides), the seed aside."""
    keep: dict[str, set[str]] = {}
    for job in jobs:
        for override in job.overrides:
            key, _, value = override.lstrip("+~").partition("=")
            if key != "seed":
                keep.setdefault(key, set()).add(value)
    return keep
