"""What the console shows: torchao's loader noise kept off it, real warnings kept on it."""

from __future__ import annotations

import enum
import logging

from runner import console
from runner.run import run
from tests.helpers import TINY_MLP, make_cfg


class Kept(logging.Handler):
    """The records a logger hands its handlers (torch's loggers may not propagate to the root,
    where pytest's caplog listens)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _kept() -> list[str]:
    """What torchao's and pytree's loggers hand their handlers of five warnings: two of them
    torchao's loader noise, three real."""
    console.quiet_torchao()
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    enum_warning = "%s is an Enum subclass and is now natively supported by torch.compile"
    Mine = enum.Enum("Mine", "A")  # a user's Enum: its warning is real
    Theirs = enum.Enum("Theirs", "A", module="torchao.float8.config")
    kept = Kept()
    # an earlier test in this worker may have disabled them or raised their level
    states = [(logger, logger.disabled, logger.level) for logger in (torchao, pytree)]
    for logger in (torchao, pytree):
        logger.disabled = False
        logger.setLevel(logging.WARNING)
        logger.addHandler(kept)
    try:
        torchao.warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
        pytree.warning(enum_warning, Theirs)
        torchao.warning("Failed to load my_checkpoint.pt")  # not a kernel library
        torchao.warning("Skipping import of cpp extensions due to incompatible torch version")
        pytree.warning(enum_warning, Mine)
    finally:
        for logger, disabled, level in states:
            logger.removeHandler(kept)
            logger.disabled, logger.level = disabled, level
    return [r.getMessage()[:30] for r in kept.records]


REAL = [
    "Failed to load my_checkpoint.p",
    "Skipping import of cpp extensi",
    "<enum 'Mine'> is an Enum subcl",
]


def test_only_torchao_loader_noise_is_held_back():
    assert _kept() == REAL


def test_an_mxfp8_run_leaves_a_users_enum_warning_on_the_console(tmp_path):
    """Converting to torchao's MXFP8Linear registers torchao's Enums; their notices are loader
    noise, a user's Enum's is not (a filter of all Enum notices, left on the logger after the
    run, hid it)."""
    run(make_cfg(*TINY_MLP, "precision=mxfp8", "trainer.max_steps=1"), tmp_path)
    assert _kept() == REAL


SUMMARY = {
    "status": "completed",
    "precision": "bf16",
    "precision_requested": "auto",
    "precision_reason": "the CPU has AVX512_BF16",
    "fp32_head": None,
    "precision_truth": {"rows": [{}], "mismatches": []},
    "steps": 30,
    "final_loss": 2.5,
    "eval_loss": 2.25,
    "best_eval_loss": 2.125,
    "eval_accuracy": 0.5,
    "samples_per_s": 1000.0,
    "samples_per_s_iqr": 50.0,
    "peak_reserved_mb": None,
    "mfu": None,
    "wall_time_s": 12.0,
    "memory": {
        "params": {"mb": 4.0, "by_dtype": {"float32": 4.0}},
        "masters": {"mb": 0.0, "by_dtype": {}},
        "activations": {"mb": 120.0, "by_dtype": {"bfloat16": 100.0, "float32": 20.0}},
        "total": 124.0,
        "peak": None,
    },
    "fp16_health": {"recommendation": "raise precision.grad_scaler.init_scale to 1e6: ..."},
    "plan_held": False,
    "precision_manifest": {"mismatches": ["Linear forward: computed in fp32, planned bf16"]},
}


def test_the_short_summary_is_what_a_person_reads_first(capsys):
    console.summary_table(SUMMARY, "short")
    printed = capsys.readouterr().out
    lines = [line.rstrip() for line in printed.splitlines()]
    assert "None" not in printed and "{" not in printed and len(lines) < 20
    assert " status           completed · 30 steps · 12.0 s" in lines
    assert " loss             final 2.5000 · eval 2.2500 (best 2.1250) · accuracy 0.5" in lines
    assert " speed            1000.0 samples/s (IQR 50.0)" in lines
    assert " plan held        no" in lines and " precision truth  as planned" in lines
    assert "activations  120  bf16 100, fp32 20" in lines  # memory: a table of its own
    assert "masters" not in printed  # nothing held there
    assert "next: the precision plan did not hold: Linear forward: computed in fp32" in printed
    assert "next: fp16 health: raise precision.grad_scaler.init_scale to 1e6" in printed


def test_summary_full_prints_every_key(capsys):
    console.summary_table(SUMMARY, "full")
    printed = capsys.readouterr().out
    for key in ("fp32_head", "peak_reserved_mb", "memory.activations.by_dtype.bfloat16"):
        assert key in printed
