"""The time-limit signal's lead: SLURM looks at time limits every 30 s and sends
`--signal=USR2@signal_delay_s` at the first look within signal_delay_s of the end, so it can come
up to 30 s early. A limit that leaves a job under a minute before that is said before submitting
(the CI's 1-minute-limit job was signalled as it started and ended FAILED)."""

from __future__ import annotations

import pytest

from runner.launch.slurm import STARTUP_LEAD_S, TIME_LIMIT_LOOK_S, early_signal


@pytest.mark.parametrize("timeout_min", [1, 2, 3, 10, 60])
@pytest.mark.parametrize("signal_delay_s", [0, 1, 30, 90, 120])
def test_a_signal_that_may_come_as_the_job_starts_is_said(timeout_min, signal_delay_s):
    params = {"timeout_min": timeout_min, "signal_delay_s": signal_delay_s}
    said = early_signal(params)
    lead = timeout_min * 60 - signal_delay_s - TIME_LIMIT_LOOK_S
    assert (said is not None) == (signal_delay_s > 0 and lead < STARTUP_LEAD_S)
    if said:
        assert f"timeout_min={timeout_min}" in said and f"signal_delay_s={signal_delay_s}" in said
        assert f"may come {max(lead, 0)} s after a job starts" in said


def test_no_time_limit_no_warning():
    assert early_signal({"signal_delay_s": 120}) is None
    assert early_signal({}) is None
