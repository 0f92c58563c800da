"""amp-runner's Hydra launchers (Hydra finds plugins only under the `hydra_plugins` package)."""
