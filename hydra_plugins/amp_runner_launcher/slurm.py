"""`+launcher=slurm`'s launcher: Hydra's submitit SLURM launcher, whose sweep accounts for every
job (runner/launch/sweep.py): the request checked before submission, finished jobs read back,
pending reasons said, and a job that ends without a result a failed row of the comparison
instead of the end of the sweep."""

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
    SlurmLauncher as SubmititSlurmLauncher,
)


class SlurmLauncher(SubmititSlurmLauncher):
    def launch(self, job_overrides, initial_job_idx):
        from runner.launch.sweep import launch  # not at plugin discovery: Hydra imports us then

        return launch(self, job_overrides, initial_job_idx)
