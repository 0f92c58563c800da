"""FLOPs, MFU and the precision audit: which dtype each op really ran in."""

from __future__ import annotations

import json

import pytest
import torch

from runner.measure import flops
from runner.measure.flops import emulation_slowdown, peak_tflops, utilisation
from runner.measure.peaks import GPU_PEAK_TFLOPS, device_model
from runner.precision import DeviceCaps, mode_of
from runner.run import run
from tests.helpers import TINY_BERT, TINY_MLP, make_cfg, read_metrics

STEP = ["trainer.max_steps=3", "trainer.val_check_interval=0"]


def test_flops_per_step_match_the_arithmetic_of_an_mlp(tmp_path):
    summary = run(make_cfg(*TINY_MLP, *STEP, "model.hidden_size=48"), tmp_path)
    batch, dims = 64, [32, 48, 48, 8]  # features → hidden → hidden → classes
    matmuls = [a * b for a, b in zip(dims, dims[1:], strict=False)]
    forward = 2 * batch * sum(matmuls)
    weight_grads = 2 * batch * sum(matmuls)
    input_grads = 2 * batch * sum(matmuls[1:])  # the first layer's input needs no gradient
    assert summary["flops_per_step"] == forward + weight_grads + input_grads


def test_the_audit_tells_low_precision_from_fp32(tmp_path):
    fp32 = run(make_cfg(*TINY_BERT, *STEP, "precision=fp32"), tmp_path / "fp32")
    bf16 = run(make_cfg(*TINY_BERT, *STEP, "precision=bf16"), tmp_path / "bf16")
    assert fp32["flops_per_step"] == bf16["flops_per_step"] > 0
    assert fp32["low_precision_flop_share"] == 0
    assert sum(fp32["fp32_ops"].values()) == fp32["flops_per_step"]
    assert bf16["low_precision_flop_share"] > 0.5
    assert "addmm" not in bf16["fp32_ops"]  # every Linear ran in bf16


def test_fp32_islands_show_up_in_the_audit(tmp_path):
    plain = run(make_cfg(*TINY_MLP, *STEP, "precision=bf16"), tmp_path / "plain")
    island = run(
        make_cfg(*TINY_MLP, *STEP, "precision=bf16", "precision.fp32_modules=[net.0]"),
        tmp_path / "island",
    )
    assert plain["low_precision_flop_share"] == 1.0 and plain["fp32_ops"] == {}
    assert 0 < island["low_precision_flop_share"] < 1
    assert island["fp32_ops"]["addmm"] > 0


def test_mfu_is_achieved_over_peak(tmp_path):
    steady = ["trainer.benchmark.warmup_steps=1"]  # a step time needs steps after the warm-up
    s = run(make_cfg(*TINY_MLP, *STEP, *steady, "precision=bf16"), tmp_path)
    assert s["achieved_tflops"] == pytest.approx(s["flops_per_step"] / s["step_time_s"] / 1e12)
    assert s["peak_tflops"] > 0 and s["mfu"] == pytest.approx(
        s["achieved_tflops"] / s["peak_tflops"]
    )


# Two checkpointable blocks (8 → 16 → 16) and a head, over batches of 16.
CHECKPOINTED = [
    "model=module",
    "model.net._target_=tests.test_own_model.Net",
    "dataset.train._target_=tests.test_own_model.pairs",
    "dataset.batch_size=16",
    "trainer.progress_bar=false",
    "logger=none",
    "trainer.max_steps=4",
    "trainer.benchmark.warmup_steps=1",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=0",
]


def test_gradient_checkpointing_adds_hardware_flops_not_model_flops(tmp_path):
    """The recomputed forwards of the two blocks are hardware FLOPs only: model FLOPs (and the
    MFU that the verdicts read) are the plain model's, HFU is larger by exactly those."""
    plain = run(make_cfg(*CHECKPOINTED), tmp_path / "plain")
    ckpt = run(make_cfg(*CHECKPOINTED, "model.gradient_checkpointing=true"), tmp_path / "ckpt")
    blocks_forward = 2 * 16 * (8 * 16 + 16 * 16)
    assert ckpt["flops_per_step"] == plain["flops_per_step"] == plain["hardware_flops_per_step"]
    assert ckpt["hardware_flops_per_step"] == plain["flops_per_step"] + blocks_forward
    assert ckpt["hfu"] / ckpt["mfu"] == pytest.approx(
        ckpt["hardware_flops_per_step"] / ckpt["flops_per_step"]
    )


# A wide first layer (1024 features → 512) over batches of 256: most of the step's FLOPs are its
# forward and its weight's gradient, layouts that PyTorch's emulated bf16/fp16 kernels run many
# times faster than the square matmuls of their measured rate (here 5-12 times).
WIDE_MLP = [
    *TINY_MLP,
    "dataset.num_features=1024",
    "dataset.batch_size=256",
    "model.hidden_size=512",
    "model.num_layers=1",
    "precision.cpu_kernels=native",
    "trainer.max_steps=4",
    "trainer.benchmark.warmup_steps=1",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=0",
]


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_an_emulated_modes_mfu_stays_within_its_peak(mode, tmp_path):
    """On a CPU without bf16/fp16 units, the mode's peak is at least fp32's: what its emulated
    kernels compute in, and what they reach on some layouts. So the MFU of a run whose matmuls
    really ran in the mode is a share, never above 1."""
    caps = DeviceCaps.probe(torch.device("cpu"))
    if caps.support(mode)[0]:
        pytest.skip(f"this CPU has {mode} units: nothing is emulated")
    s = run(make_cfg(*WIDE_MLP, f"precision={mode}"), tmp_path)
    assert s["low_precision_flop_share"] == 1.0 and s["peak_mode"] == mode
    assert 0 < s["mfu"] <= s["hfu"] <= 1 and "above_peak" not in s


def test_a_step_faster_than_the_peak_is_reported_not_shown(tmp_path, capsys):
    """A CPU ceiling measured while the machine was busy is no ceiling: the run's rate above it
    is a warning and a null MFU, never an MFU over 100%."""
    caps = DeviceCaps.probe(torch.device("cpu"))
    key = f"{caps.name}|{torch.get_num_threads()}|{torch.__version__}|{torch.float32}"
    (tmp_path / "cpu_peak_tflops.json").write_text(json.dumps({key: {"tflops": 1e-9}}))
    threads = f"trainer.cpu_threads={torch.get_num_threads()}"  # the key's, however busy the CPU
    s = run(make_cfg(*CHECKPOINTED, f"cache_dir={tmp_path}", threads), tmp_path / "run")
    achieved = s["flops_per_step"] / s["step_time_s"] / 1e12
    assert s["peak_tflops"] == 1e-9 and s["above_peak"] == pytest.approx(achieved / 1e-9)
    assert s["mfu"] is None and s["hfu"] is None
    assert "that peak is not this device's ceiling" in s["peak_note"]
    assert "peak is not this device's ceiling" in " ".join(capsys.readouterr().err.split())


def test_gpu_peaks_come_from_the_datasheet_table(tmp_path):
    h200 = DeviceCaps("cuda", "NVIDIA H200", (9, 0))
    assert peak_tflops(h200, mode_of("bf16"), tmp_path) == 989.5  # 1979 with sparsity, halved
    assert peak_tflops(h200, mode_of("tf32"), tmp_path) == 494.5
    assert peak_tflops(DeviceCaps("cuda", "Tesla T4", (7, 5)), mode_of("bf16"), tmp_path) is None
    assert peak_tflops(DeviceCaps("cuda", "Mystery GPU", (9, 0)), mode_of("fp16"), tmp_path) is None


# What torch.cuda.get_device_name() reports, and the datasheet model each one is.
DEVICE_NAMES = [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM"),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM"),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe"),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA GB200", "GB200"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40", "L40"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA A10G", "A10G"),
    ("Tesla T4", "T4"),
    ("Tesla V100-SXM2-16GB", "V100 SXM"),
    ("Tesla V100-SXM2-32GB", "V100 SXM"),
    ("Tesla V100-PCIE-32GB", "V100 PCIe"),
    ("NVIDIA GeForce RTX 3090", "RTX 3090"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA GeForce RTX 5090", "RTX 5090"),
    ("AMD Instinct MI300X", "MI300X"),
]


@pytest.mark.parametrize(("name", "model"), DEVICE_NAMES)
def test_each_device_name_resolves_to_its_own_model(name, model, tmp_path):
    assert device_model(name) == model
    caps = DeviceCaps("cuda", name, (9, 0))
    assert peak_tflops(caps, mode_of("fp32"), tmp_path) == GPU_PEAK_TFLOPS[model]["fp32"]
    assert peak_tflops(caps, mode_of("fp16"), tmp_path) == GPU_PEAK_TFLOPS[model]["fp16"]


def test_every_model_in_the_table_has_a_device_name_that_reaches_it():
    assert {model for _, model in DEVICE_NAMES} == set(GPU_PEAK_TFLOPS)


def test_a_name_that_contains_another_models_name_gets_its_own_peak(tmp_path):
    def bf16(name: str) -> float | None:
        return peak_tflops(DeviceCaps("cuda", name, (8, 9)), mode_of("bf16"), tmp_path)

    assert bf16("NVIDIA L40S") == 362.05
    assert bf16("NVIDIA L40S") not in (
        GPU_PEAK_TFLOPS["L4"]["bf16"],
        GPU_PEAK_TFLOPS["L40"]["bf16"],
    )
    assert bf16("NVIDIA L40") == 181.05 != GPU_PEAK_TFLOPS["L4"]["bf16"]
    assert bf16("NVIDIA H100 NVL") == 835.5 != GPU_PEAK_TFLOPS["H100 SXM"]["bf16"]
    assert bf16("NVIDIA H200 NVL") == 835.5 != GPU_PEAK_TFLOPS["H200 SXM"]["bf16"]


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA RTX A6000",
        "NVIDIA L4X",
        "NVIDIA H100",  # no form factor and no HBM3: could be PCIe, SXM or NVL
        "NVIDIA GH200 480GB",
        "Tesla V100S-PCIE-32GB",
        "NVIDIA GeForce RTX 4090 D",
    ],
)
def test_an_unknown_device_gets_no_peak_and_a_note_not_a_neighbours_peak(name, tmp_path):
    caps = DeviceCaps("cuda", name, (8, 6))
    assert device_model(name) is None
    assert all(peak_tflops(caps, mode_of(m), tmp_path) is None for m in ("fp32", "bf16", "fp16"))
    summary = {"flops_per_step": 2e12, "step_time_s": 0.5}
    u = utilisation(summary, caps, mode_of("bf16"), tmp_path)
    assert u["achieved_tflops"] == 4 and u["peak_tflops"] is None and u["mfu"] is None
    assert u["peak_note"] == f"no datasheet peak for {name}: MFU left out"


def test_fp8_is_looked_up_where_the_device_has_it_and_none_where_it_does_not(tmp_path):
    def peak(name: str, mode: str) -> float | None:
        return peak_tflops(DeviceCaps("cuda", name, (9, 0)), mode_of(mode), tmp_path)

    assert peak("NVIDIA H100 80GB HBM3", "fp8") == 1979
    assert peak("NVIDIA GeForce RTX 4090", "fp8") == 330.3  # with FP32 accumulate
    assert peak("AMD Instinct MI300X", "fp8") == 2614.9
    assert peak("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert peak("Tesla T4", "fp8") is None
    assert peak("Tesla V100-SXM2-16GB", "bf16") is None
    assert peak("Tesla V100-SXM2-16GB", "tf32") is None
    u = utilisation(
        {"flops_per_step": 1e12, "step_time_s": 1.0},
        DeviceCaps("cuda", "NVIDIA A100-SXM4-80GB", (8, 0)),
        mode_of("fp8"),
        tmp_path,
    )
    assert u["mfu"] is None and "no fp8 datasheet peak" in u["peak_note"]
    u = utilisation(
        {"flops_per_step": 989.5e12, "step_time_s": 2.0},
        DeviceCaps("cuda", "NVIDIA H100 80GB HBM3", (9, 0)),
        mode_of("fp8"),
        tmp_path,
    )
    assert u["peak_tflops"] == 1979 and u["mfu"] == pytest.approx(0.25) and "peak_note" not in u
    # Both conventions, and which peak `mfu` divides by; bf16's own run needs neither.
    assert u["peak_mode"] == "fp8" and u["mfu_vs_mode_peak"] == u["mfu"]
    assert u["mfu_vs_bf16_peak"] == pytest.approx(0.5)  # 494.75 TFLOP/s over bf16's 989.5
    bf16 = utilisation(
        {"flops_per_step": 989.5e12, "step_time_s": 2.0},
        DeviceCaps("cuda", "NVIDIA H100 80GB HBM3", (9, 0)),
        mode_of("bf16"),
        tmp_path,
    )
    assert bf16["mfu"] == pytest.approx(0.5) and bf16["peak_mode"] == "bf16"
    assert "mfu_vs_bf16_peak" not in bf16 and "mfu_vs_mode_peak" not in bf16


@pytest.fixture
def counted_measure(monkeypatch):
    """The real matmul measurement, made small, counting its calls."""
    real, calls = flops._measure_matmul_tflops, []

    def measure(dtype):
        calls.append(dtype)
        return real(dtype, n=64, runs=3, seconds=0.01)

    monkeypatch.setattr(flops, "_measure_matmul_tflops", measure)
    return calls


CPU = DeviceCaps("cpu", "Test CPU @ 1.0GHz")


def _cache_key(dtype: torch.dtype) -> str:
    return f"{CPU.name}|{torch.get_num_threads()}|{torch.__version__}|{dtype}"


def test_the_cpu_ceiling_is_cached_with_its_conditions_and_reused(tmp_path, counted_measure):
    peak = peak_tflops(CPU, mode_of("fp32"), tmp_path)
    assert len(counted_measure) == 1
    entry = json.loads((tmp_path / "cpu_peak_tflops.json").read_text())[_cache_key(torch.float32)]
    assert entry["cpu"] == CPU.name and entry["threads"] == torch.get_num_threads()
    assert entry["torch"] == torch.__version__ and entry["dtype"] == "float32"
    assert entry["n"] == 64 and entry["runs"] == 3 and entry["measured_at"]
    assert peak == entry["tflops"] >= entry["median_tflops"] > 0
    assert peak_tflops(CPU, mode_of("fp32"), tmp_path) == peak
    # a CPU has no TF32: the fp32 ceiling
    assert peak_tflops(CPU, mode_of("tf32"), tmp_path) == peak
    assert len(counted_measure) == 1
    peak_tflops(CPU, mode_of("bf16"), tmp_path)  # another dtype is measured on its own
    assert counted_measure == [torch.float32, torch.bfloat16]


def test_another_thread_count_measures_the_cpu_again(tmp_path, counted_measure, monkeypatch):
    peak_tflops(CPU, mode_of("fp32"), tmp_path)
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    peak_tflops(CPU, mode_of("fp32"), tmp_path)
    assert len(counted_measure) == 2
    cache = json.loads((tmp_path / "cpu_peak_tflops.json").read_text())
    assert sorted(e["threads"] for e in cache.values()) == [threads, threads + 1]


@pytest.mark.parametrize("stale", ['{"%s": 123.0}', "{not json"])
def test_an_old_bare_float_or_damaged_cache_is_measured_again(tmp_path, counted_measure, stale):
    path = tmp_path / "cpu_peak_tflops.json"
    path.write_text(stale.replace("%s", _cache_key(torch.float32)))
    peak = peak_tflops(CPU, mode_of("fp32"), tmp_path)
    assert len(counted_measure) == 1 and peak != 123.0
    assert json.loads(path.read_text())[_cache_key(torch.float32)]["tflops"] == peak


def test_a_cpu_has_no_fp8_ceiling(tmp_path, counted_measure):
    u = utilisation({"flops_per_step": 1e9, "step_time_s": 0.1}, CPU, mode_of("fp8"), tmp_path)
    assert u["mfu"] is None and "no fp8 matmul ceiling" in u["peak_note"]
    assert u["mfu_vs_bf16_peak"] is None and u["mfu_vs_mode_peak"] is None
    assert counted_measure == []


def test_the_real_matmul_measurement_is_the_best_of_its_runs():
    m = flops._measure_matmul_tflops(torch.float32, n=32, runs=4, seconds=0.005)
    assert m["runs"] == 4 and m["n"] == 32 and m["seconds_per_run"] == 0.005
    assert m["tflops"] >= m["median_tflops"] > 0
    # A spent budget (slow emulated matmuls) still leaves two runs to take the best of.
    m = flops._measure_matmul_tflops(torch.float32, n=32, runs=5, seconds=0.005, budget_s=0)
    assert m["runs"] == 2


def test_speed_figures_leave_out_the_warm_up_and_flag_an_input_bound_run(tmp_path, capsys):
    cfg = make_cfg(
        *TINY_MLP,
        "trainer.max_steps=12",
        "trainer.log_every_n_steps=10",
        "trainer.benchmark.warmup_steps=3",
        "dataset._target_=tests.probes.SlowBlobs",
    )
    summary = run(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    assert len({r["step_time_s"] for r in rows[:3]}) == 1  # the warm-up is an interval of its own
    assert rows[3]["step_time_s"] != rows[2]["step_time_s"]
    assert summary["step_time_p90_s"] >= summary["step_time_s"] >= 0.02
    assert 0.5 < summary["data_wait_share"] <= 1
    assert "input-bound" in capsys.readouterr().err


def test_the_slowdown_of_an_emulated_mode_is_measured_and_native_modes_have_none(tmp_path):
    emulating = DeviceCaps("cpu", "a CPU without bf16 units")
    factor = emulation_slowdown(emulating, mode_of("bf16"), tmp_path)
    assert isinstance(factor, float) and factor > 0  # fp32's ceiling over bf16's, both measured
    native = DeviceCaps("cpu", "a CPU with AMX", cpu_flags=frozenset({"amx_bf16"}))
    assert emulation_slowdown(native, mode_of("bf16"), tmp_path) is None
    assert emulation_slowdown(emulating, mode_of("fp32"), tmp_path) is None


def test_the_steps_after_the_audit_pay_for_no_manifest_and_no_config_reads(tmp_path, monkeypatch):
    """Trainer.fit's steady steps (fp16 with its scaler, on an HF BERT): after the audited first
    step no module hook, dispatch mode, saved-tensor hook or manifest call is left, and the loop
    reads no OmegaConf value (each read costs Python time a bare loop does not pay)."""
    from omegaconf import DictConfig
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from runner.measure.error_table import MatmulErrors
    from runner.measure.matmul_error import ErrorProbe
    from runner.measure.matmuls import MatmulLog
    from runner.measure.memory import SavedActivations
    from runner.measure.module_stack import ModuleStack
    from runner.train.trainer import Trainer

    seen = {"config": 0, "manifest": 0, "hooks": 0, "dispatch": 0, "steady": 0}
    steady = [False]  # between an audited step's end and the next flush

    def counted(original, key):
        def wrapper(*args, **kwargs):
            seen[key] += steady[0]
            return original(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(DictConfig, "_get_impl", counted(DictConfig._get_impl, "config"))
    for cls, name in (
        (MatmulLog, "observe"),
        (ModuleStack, "_before"),
        (SavedActivations, "counting"),
        (ErrorProbe, "_pre"),  # each matmul's error: its hooks, and the measured steps
        (MatmulErrors, "_measuring"),
    ):
        monkeypatch.setattr(cls, name, counted(getattr(cls, name), "manifest"))
    train_step, flush = Trainer.train_step, Trainer._flush

    def step(self, window):
        steady[0] = self.step >= 1
        if steady[0]:
            seen["steady"] += 1
            seen["hooks"] += sum(
                len(m._forward_hooks) + len(m._forward_pre_hooks) for m in self.task.modules()
            )
            seen["dispatch"] += _get_current_dispatch_mode() is not None
        return train_step(self, window)

    def flushing(self, due, bar):
        steady[0] = False  # logging and evaluation read the config: not a step's cost
        return flush(self, due, bar)

    monkeypatch.setattr(Trainer, "train_step", step)
    monkeypatch.setattr(Trainer, "_flush", flushing)
    overrides = ["trainer.max_steps=4", "trainer.benchmark.warmup_steps=1", "precision=fp16"]
    overrides.append("precision.matmul_error=true")  # its probe on the audited step only
    run(make_cfg(*TINY_BERT, *overrides, "trainer.val_check_interval=0"), tmp_path)
    assert seen == {"config": 0, "manifest": 0, "hooks": 0, "dispatch": 0, "steady": 3}
