"""Hydra's context for the command's own process during a multirun."""

from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback


class SweepContextCallback(Callback):
    """Sets Hydra's context (HydraConfig) in the sweep's process at the multirun's start, where
    no job has set it yet. Hydra sets it only as a job runs in the process; a launcher whose
    jobs run elsewhere (Ray) leaves it unset, so `${hydra:runtime.cwd}` in the default
    `hydra.sweep.dir` (conf/launcher/ray.yaml) could not be resolved by the sweeper, the
    comparison or the launcher: the sweep ended in "HydraConfig was not set". Listed before the
    comparison's callback (conf/config.yaml), which reads the sweep folder too."""

    def on_multirun_start(self, config, **kwargs) -> None:
        if not HydraConfig.initialized():
            HydraConfig.instance().set_config(config)
