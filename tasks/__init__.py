"""What amp-runner trains: models, datasets and losses. Configs point here with `_target_`."""
