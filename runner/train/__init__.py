"""The training engine: the loop (`trainer`), its meter (`telemetry`), checkpoints (`checkpoint`,
`sharded`), preemption signals, the forensics of a non-finite step (`diagnostics`), ranks and
collectives (`distributed`) and the optimizers (`optim`)."""
