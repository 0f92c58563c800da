"""`hydra/launcher=joblib`'s launcher: Hydra's joblib launcher, whose sweep survives a worker
that dies (runner/launch/local.py): the comparison still runs, naming the jobs it lost."""

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import (
    JoblibLauncher as HydraJoblibLauncher,
)


class JoblibLauncher(HydraJoblibLauncher):
    def launch(self, job_overrides, initial_job_idx):
        from joblib.externals.loky.process_executor import TerminatedWorkerError

        try:
            return super().launch(job_overrides, initial_job_idx)
        except TerminatedWorkerError as e:
            from runner.launch.local import after_dead_worker

            return after_dead_worker(self, job_overrides, initial_job_idx, e)


# `hydra/launcher=joblib` is this launcher, with the plugin's own keys and defaults: the option
# is stored again over the plugin's (imported above, so its entry is already there to replace).
ConfigStore.instance().store(
    group="hydra/launcher",
    name="joblib",
    node=JobLibLauncherConf(_target_=f"{__name__}.JoblibLauncher"),
    provider="amp_runner",
)
