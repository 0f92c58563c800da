"""`python -m runner.export RUN_DIR [--out DIR] [--checkpoint PATH]`: a LoRA fine-tune's adapters
(model.peft) written with PEFT's `save_pretrained` (adapter_config.json and
adapter_model.safetensors, in fp32), from the run's newest checkpoint that loads. `peft` alone
loads them onto the base: `PeftModel.from_pretrained(base_model, DIR)`; amp-runner is not needed.

The run's model is rebuilt from the config its checkpoint holds (as a resume rebuilds it) and the
checkpoint loaded into it; `export(run_dir)` is the same from Python."""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import OmegaConf

from runner import console
from runner.errors import UserError, fail


def export(run_dir: Path, out: Path | None = None, checkpoint_path: Path | None = None) -> Path:
    """Writes the adapters of the run in `run_dir` to `out` (default RUN_DIR/adapter); returns
    `out`."""
    from runner.build import build, seed_everything  # heavy imports after the command line is good
    from runner.train import checkpoint, frozen

    run_dir = Path(run_dir)
    found = checkpoint.find_resume(str(checkpoint_path) if checkpoint_path else "auto", run_dir)
    if found is None:
        raise UserError(f"{run_dir} has no checkpoint to export (checkpoints/last.pt)")
    path, state = found
    if "set" in state:
        raise UserError(f"{path} is a sharded (FSDP) set: export reads single-file checkpoints")
    if "config" not in state or state["config"]["model"].get("peft") is None:
        raise UserError(f"{path} holds no adapters: its run did not set model.peft")
    cfg = OmegaConf.create(state["config"])
    seed_everything(cfg.seed)  # as the run did before building: the same base, if random
    _, task = build(cfg)
    try:
        task.load_state_dict(frozen.full_state(task, state))
    except RuntimeError as e:
        raise UserError(f"{path} does not fit the model its config builds: {e}") from None
    out = Path(out) if out is not None else run_dir / "adapter"
    task.net.save_pretrained(out)
    console.say(
        f"adapters of {path} (step {state['step']}) written to {out}: load them with "
        f"peft.PeftModel.from_pretrained(base_model, {str(out)!r})"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m runner.export",
        description="Write a LoRA fine-tune's adapters with PEFT's save_pretrained.",
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help="the folder to write (default: RUN_DIR/adapter)")
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint (default: the newest)")
    args = parser.parse_args(argv)
    try:
        export(args.run_dir, args.out, args.checkpoint)
    except UserError as e:
        fail(e)


if __name__ == "__main__":
    main()
