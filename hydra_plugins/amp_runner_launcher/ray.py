"""`hydra/launcher=ray`'s launcher (`+launcher=ray`), where the `ray` extra is installed: Hydra's
Ray launcher, whose sweep survives a job Ray loses (its worker killed, out of memory, its node
gone): every job is waited for, one that ended without a result is named as failed, and the
comparison of the others still runs (and the command exits non-zero). A job that completed in
the sweep folder before is read back, not run again: the same command completes the sweep."""

from pathlib import Path

from hydra.core.config_store import ConfigStore

try:
    from hydra_plugins.hydra_ray_launcher._config import RayLauncherConf
    from hydra_plugins.hydra_ray_launcher.ray_launcher import RayLauncher as HydraRayLauncher
except ImportError:  # the `ray` extra is not installed: hydra/launcher=ray says so itself
    HydraRayLauncher = None


if HydraRayLauncher is not None:

    class RayLauncher(HydraRayLauncher):
        def launch(self, job_overrides, initial_job_idx):
            import ray
            from hydra.core.singleton import Singleton
            from hydra.core.utils import setup_globals
            from hydra_plugins.hydra_ray_launcher._launcher_util import (
                launch_job_on_ray,
                start_ray,
            )
            from omegaconf import open_dict

            from runner.launch.jobs import read_back, record, say, sweep_jobs, unfinished

            setup_globals()
            Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
            start_ray(self.ray_cfg.init)
            jobs = sweep_jobs(self, [list(o) for o in job_overrides], initial_job_idx)
            returns = {job.num: read_back(job) for job in jobs}
            for job in jobs:
                if returns[job.num] is None:
                    with open_dict(job.config):
                        job.config.hydra.job.id = f"ray_{job.num}"
                    say(f"{job.label}: on Ray")
                    job.submitted = launch_job_on_ray(
                        self.hydra_context,
                        self.ray_cfg.remote,
                        job.config,
                        self.task_function,
                        Singleton.get_state(),
                    )
            for job in jobs:
                if job.submitted is None:
                    continue
                try:
                    returns[job.num] = ray.get(job.submitted)
                except ray.exceptions.RayError as e:
                    why = f"lost by Ray ({type(e).__name__}: its worker ended without a result)"
                    record(job, "ray", "LOST", why)
                    returns[job.num] = unfinished(job, why)
            return [returns[job.num] for job in jobs]

    # `hydra/launcher=ray` is this launcher, with the plugin's own keys and defaults: stored
    # again over the plugin's entry (imported above, so it is there to replace).
    ConfigStore.instance().store(
        group="hydra/launcher",
        name="ray",
        node=RayLauncherConf(_target_=f"{__name__}.RayLauncher"),
        provider="amp_runner",
    )
