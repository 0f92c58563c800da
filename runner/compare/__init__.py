"""The comparison of a sweep's precisions: `python -m runner.compare SWEEP_DIR`.

jobs.py reads each job and says what it ran; verdicts.py groups the seeds of a row and judges it
against its baseline; interleave.py times a setting's rows again side by side; report.py writes
the table, the notes and the dashboard; sweep.py puts them together (and is the multirun's
callback)."""

from runner.compare.sweep import CompareCallback, compare

__all__ = ["CompareCallback", "compare"]
