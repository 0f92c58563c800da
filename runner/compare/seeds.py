"""`runner.seeds=auto`: seeds added until every row's verdict is decided, with a guarantee that
holds over the whole sweep.

The sweep runs AUTO_SEEDS seeds of every job, then compares. A row is undecided where an
interval its verdict rests on still holds the boundary it is judged against: the loss gap's
reaches past the tolerance, or the time to target's holds 1 (`figures["undecided"]`, set by
runner/compare/verdicts.py). Each undecided row that has kept pace with its baseline (every
look so far found it undecided) runs one more seed with its baseline, both below
runner.max_seeds, and the comparison looks again; it stops where every row is decided or has
reached the cap. A seed that diverges or never reaches the target counts as such (the row is
then decided: not recommended), never dropped.

What decides a row never moves once it is decided: the default target is taken from the
baseline's seeds of the first look (`first_look`) and every row's speed, memory and MFU from
its own seeds of the first look (runner/compare/groups.py); the interleaved timing is taken
once, at the first look, and read back at the later ones (`timings`); a row is paired only with
the baseline's jobs of its own seeds, its speed contended only by its first look's seeds. A
decided row runs no more seeds (`next_round` runs only the rows that go on), so what its
verdict rests on at the last look is what it had when decided (its baseline turning unstable,
or another row becoming the best, can still change its words).

The family-wise error: every interval that decides a row (DECIDING: the loss gap's and the
time to target's) of every row judged against a baseline, at every look the sweep may take
(at most max_seeds − AUTO_SEEDS + 1, known before the first), is taken at 1 − 5%/(looks ×
rows × DECIDING) (Bonferroni's split): whenever the sweep stops, where the t intervals'
assumption holds (normal log ratios), the chance that any of those intervals misses its truth
is at most 5%, and with it the chance that any word they decide is wrong. It costs width, but
it holds for every stopping rule and every dependence between rows (they share a baseline) and
needs nothing the t intervals do not already assume (skew on the log scale, a constant plus a
lognormal added to the loss, took it to 9.7%: docs/comparison.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from runner.compare.groups import SPEED
from runner.compare.stats import CONFIDENCE
from runner.config.commandline import ROUND
from runner.config.schema import AUTO_SEEDS
from runner.errors import UserError
from runner.files import write_text
from runner.folders import rerun_key

if TYPE_CHECKING:
    from runner.compare.groups import Group
    from runner.compare.jobs import Job
    from runner.config import RunnerConfig

DECIDING = 2  # the intervals that decide a row: its loss gap's and its time to target's
TIMING = "seeds_auto_timing.json"  # an auto sweep's interleaved timing, from its first look


def looks(max_seeds: int) -> int:
    """The comparisons an auto sweep may make: after AUTO_SEEDS seeds, then after each more."""
    return max(1, max_seeds - AUTO_SEEDS + 1)


def judged_rows(groups: list[Group]) -> int:
    """The rows judged against a baseline (at least 1): the sweep's rows less its baselines."""
    return max(1, sum(g.base is not None and g.base is not g for g in groups))


def level(settings: RunnerConfig, groups: list[Group]) -> float:
    """The confidence of every interval of the sweep: 95%, or where auto, 5% split over the
    looks, the rows and the intervals that decide each."""
    if settings.seeds != "auto":
        return CONFIDENCE
    splits = looks(settings.max_seeds) * judged_rows(groups) * DECIDING
    return 1 - (1 - CONFIDENCE) / splits


def first_look(jobs: list[Job], settings: RunnerConfig) -> frozenset | None:
    """In an auto sweep, the seeds of its first look (its AUTO_SEEDS lowest: the later rounds
    take seeds past the sweep's last), which the default target and each row's own speed come
    from; None for a sweep of fixed seeds."""
    if settings.seeds != "auto":
        return None
    seeds = sorted({j.config.get("seed") for j in jobs} - {None})
    return frozenset(seeds[:AUTO_SEEDS])


def timings(groups: list[Group], settings: RunnerConfig, sweep: Path, look: set | None) -> dict:
    """The rows timed interleaved (runner/compare/interleave.py): where an auto sweep holds a
    later round's jobs, the first look's timing, read back from TIMING, so that a row decided
    by it stays decided, at the sweep's later looks (`look`: the rounds this process ran) and in
    its comparison run again (`look` None: python -m runner.compare); else timed now, and at an
    auto sweep's first look written there. A torn TIMING is named in one line (UserError)."""
    from runner.compare.interleave import time_sweep  # torch: only when it times

    path = sweep / TIMING
    jobs = [j for g in groups for j in g.jobs]
    later = any(j.folder.name.startswith(ROUND.format(seed=j.config.get("seed"))) for j in jobs)
    if settings.seeds == "auto" and later and path.exists():
        try:
            saved = json.loads(path.read_text())
            rows = {g.key: dict(saved[g.label]) for g in groups if g.label in saved}
            if any(k not in row for row in rows.values() for k in SPEED):
                raise KeyError("a row's speed missing")
            return rows
        except (ValueError, TypeError, KeyError) as e:
            raise UserError(
                f"{path} unreadable (torn or garbled: {e}): the first look's interleaved timing; "
                "delete it to time the rows again"
            ) from None
    measured = time_sweep(groups, settings)
    if look is not None:
        kept = {g.label: measured[g.key] for g in groups if g.key in measured}
        write_text(path, json.dumps(kept, indent=1) + "\n")
    return measured


def stopped(groups: list[Group], settings: RunnerConfig) -> None:
    """Each row's `seeds_stopped` (why it has the seeds it has, in words) in an auto sweep, and
    `more_seeds`: whether it runs one more (the undecided that kept pace with their baseline,
    both below the cap, and their baselines)."""
    if settings.seeds != "auto":
        return
    cap = settings.max_seeds
    more = [
        g for g in groups if g.figures.get("undecided") and len(g.jobs) == len(g.base.jobs) < cap
    ]
    bases = {g.base for g in more}
    for g in groups:
        f = g.figures
        if f.get("undecided"):
            open_ = f"its {f['undecided']} interval still open"
            f["seeds_stopped"] = (
                f"undecided: {open_}; one more seed follows"
                if g in more
                else f"the cap, runner.max_seeds={cap}: {open_}"
                if len(g.jobs) >= cap
                else f"undecided at {len(g.jobs)} seeds, its baseline at {len(g.base.jobs)}: "
                f"{open_}, and a row behind its baseline's seeds runs no more (an earlier look "
                "decided it, under other compare.* settings, or its seeds came from another command)"
            )
        elif g in bases:
            f["seeds_stopped"] = "the baseline of undecided rows; one more seed follows"
        else:
            f["seeds_stopped"] = "the baseline" if g.base in (None, g) else "decided"
    for g in groups:
        g.figures["more_seeds"] = g in more or g in bases


def next_round(groups: list[Group], ran: set[int]) -> tuple[int, list] | None:
    """The next round of an auto sweep, None where it is done: its seed and its blocks, each
    a (job folders' name, values by override key) that runner/config/commandline.py's
    seed_round makes a command line of, whose cross product is the block's jobs. First, a
    later round that this process has not run (`ran`) and some of whose jobs did not complete
    (a sweep run again to complete it): its jobs again, each in its own folder, so the
    completed ones are read back and the rest run. Else one past the sweep's last seed, for
    the rows that go on (`more_seeds`) only: a block per setting, its precisions listed, so
    that no decided row runs a seed more."""
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
        members = sorted(rounds[again[0]], key=lambda j: j.folder.name)
        return again[0], [(j.folder.name, _values([j])) for j in members]
    rows = [g for g in groups if g.figures.get("more_seeds")]
    if not rows:
        return None
    seed = 1 + max(j.config.get("seed", 0) for j in jobs)
    blocks: dict[tuple, list] = {}  # the rows' first jobs, by every value but the precision
    for g in rows:
        values = _values(g.jobs[:1])
        setting = tuple((k, *v) for k, v in values.items() if k != "precision")
        blocks.setdefault((*setting, "precision" in values), []).append(g.jobs[0])
    several = len(blocks) > 1  # folders seed<S>-<block>-<n>, else seed<S>-<n>
    return seed, [
        (ROUND.format(seed=seed) + (f"{b}-" if several else "") + "${hydra.job.num}", _values(x))
        for b, x in enumerate(blocks.values())
    ]


def _values(jobs: list) -> dict[str, list[str]]:
    """By override key (its + or ~ kept), the values `jobs` set on their command lines, the
    seed aside, and those a rerun may change (runner.max_seeds, compare.*: the command's
    stand)."""
    out: dict[str, list[str]] = {}
    for job in jobs:
        for override in job.overrides:
            key, _, value = override.partition("=")
            if key.lstrip("+~") == "seed" or rerun_key(override):
                continue
            if value not in out.setdefault(key, []):
                out[key].append(value)
    return out
