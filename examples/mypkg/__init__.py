"""An example of a user's own package: a net, a dataset and a config option, nothing from
amp-runner imported. See README, "Your own model"."""
