"""summary.json's renamed keys: the converting modes' section (fp8, mxfp8, nvfp4, mxfp4), once
named for fp8 alone, is `converted`, its FLOP keys `converted_flops_per_step` and
`converted_flop_share`. A run writes the section under its old name too, its keys under theirs
(an alias for existing readers: docs/run-output.md), and the runner's readers take a run written
before the rename as one written after it."""

from __future__ import annotations

SECTION, OLD_SECTION = "converted", "fp8"
# the section's renamed keys → their old names (the others kept theirs: fp4_health, kernels, ...)
OLD_KEYS = {
    "converted_flops_per_step": "fp8_flops_per_step",
    "converted_flop_share": "fp8_flop_share",
}


def with_aliases(summary: dict) -> dict:
    """`summary` with its converted section also under the old name, each key as it was."""
    section = summary.get(SECTION)
    if not isinstance(section, dict):
        return summary
    return summary | {OLD_SECTION: {OLD_KEYS.get(k, k): v for k, v in section.items()}}


def converted_section(summary: dict) -> dict:
    """A run's converted section by its new names, also from a run that wrote only the old ones;
    {} where it ran no converting mode."""
    section = summary.get(SECTION)
    if isinstance(section, dict):
        return section
    old = summary.get(OLD_SECTION)
    if not isinstance(old, dict):
        return {}
    new_keys = {old_key: key for key, old_key in OLD_KEYS.items()}
    return {new_keys.get(k, k): v for k, v in old.items()}


def converted_share(summary: dict):
    """fp8, mxfp8, nvfp4, mxfp4: the share of a step's FLOPs its converted Linears computed in the
    mode's format; under precision.autopilot, over the run's steps, its switches included."""
    if isinstance(pilot := summary.get("autopilot"), dict):
        return pilot.get("low_flop_share")
    return converted_section(summary).get("converted_flop_share")
