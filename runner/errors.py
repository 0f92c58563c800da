"""Exceptions the entry point turns into a single line and a non-zero exit (no traceback)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class UserError(Exception):
    """Bad input from the user: a config value, a file, a device. The message is the whole story."""


class TrainingStopped(UserError):
    """The run stopped itself: persistent non-finite values. Its report is in nonfinite.json."""

    exit_code = 1


class Preempted(Exception):
    """SIGTERM, SIGUSR1 or SIGUSR2 arrived (or the job's end time is near): the current step
    finished and a checkpoint was written; or training had not started, and there was nothing to
    save."""

    exit_code = 75  # EX_TEMPFAIL: try again (with trainer.resume=auto)

    def __init__(self, signal_name: str | None, step: int | None, why: str | None = None):
        """`signal_name`: None where the signal reached another rank only. `step`: None before
        training. `why`: what asked for the stop, where it was not a signal (the time limit)."""
        signal_name = signal_name or "a preemption signal to another rank"
        if step is None:
            said = f"preempted by {signal_name} before training: nothing to checkpoint"
        else:
            said = f"preempted by {why or signal_name} at step {step}: checkpoint saved"
        super().__init__(said)
        self.signal_name, self.step = signal_name, step


def clip(text: str, limit: int = 120) -> str:
    """`text`, cut to `limit` characters where it is longer (a value echoed in an error line)."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)"


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


@contextmanager
def building(key: str, node: Mapping) -> Iterator[None]:
    """Turns a failure to build `key` (a config node with `_target_`) into one UserError line
    that names the group, its target and the cause: task-owned groups have no schema, so a bad
    value there first shows up as an exception from the constructor it is passed to."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        from hydra.errors import InstantiationException  # hydra is loaded by now

        cause: BaseException = e
        # Hydra wraps what the target raised (message: its repr and the full key), and a target
        # it cannot import as "Error loading 'x':" and the ImportError: the cause is the part
        # the user can act on.
        while cause.__cause__ is not None and (
            isinstance(cause, InstantiationException) or first_line(cause).endswith(":")
        ):
            cause = cause.__cause__
        if isinstance(cause, UserError):  # the task's own check, already one clear line
            raise cause from None
        target = node.get("_target_") if isinstance(node, Mapping) else None
        what = f"{key} ({target})" if target else key
        raise UserError(f"cannot build {what} from the config: {first_line(cause)}") from cause


def fail(error: UserError) -> None:
    """One line on stderr, then exit: 2 for bad input, 1 for a run that stopped itself."""
    print(f"error: {clip(str(error), 600)}", file=sys.stderr)
    sys.exit(getattr(error, "exit_code", 2))
