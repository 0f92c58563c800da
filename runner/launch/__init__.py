"""Launching a sweep's jobs on a cluster and waiting for them (SLURM here): what the launcher
plugins in hydra_plugins/amp_runner_launcher/ do, beside Hydra's own launchers."""
