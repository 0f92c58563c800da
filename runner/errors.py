"""Exceptions the entry point turns into a single line and a non-zero exit (no traceback)."""


class UserError(Exception):
    """Bad input from the user: a config value, a file, a device. The message is the whole story."""


class TrainingStopped(UserError):
    """The run stopped itself: persistent non-finite values. Its report is in nonfinite.json."""

    exit_code = 1


class Preempted(Exception):
    """SIGTERM or SIGUSR1 arrived: the current step finished and a checkpoint was written."""

    exit_code = 75  # EX_TEMPFAIL: try again (with trainer.resume=auto)

    def __init__(self, signal_name: str, step: int):
        super().__init__(f"preempted by {signal_name} at step {step}: checkpoint saved")
        self.signal_name, self.step = signal_name, step
