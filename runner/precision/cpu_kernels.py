"""precision.cpu_kernels: bf16/fp16 numerics at fp32 speed on a CPU without bf16/fp16 units.

On a CPU without AMX or AVX512-BF16/FP16, PyTorch's bf16 and fp16 matmuls and convolutions run
scalar fallbacks, 20-200x slower than fp32. What they compute is fp32 arithmetic on low-precision
inputs (a product of two bf16 or fp16 values is exact in fp32, and the kernels accumulate in
fp32, as GPUs do), rounded once to the output's dtype. `fast` computes just that: the inputs cast
to fp32, PyTorch's fp32 kernel, the output rounded to the op's dtype. Results agree with the
native kernels' to within summation order (an element here and there one unit of the last
place apart). One known difference: the CPU flash-attention kernel rounds its softmax
probabilities to bf16/fp16 before multiplying them by the values; the fp32 kernel keeps them
in fp32.

The mechanism is a kernel for each matmul-like aten op at the dispatcher's BackendSelect key,
registered while a run's `fit` lasts and removed after it (`FastKernels`). BackendSelect lies
below autograd, autocast and the Python key (dispatch modes, fake tensors), just above the
CPU kernels, so:
- autograd records the bf16 op as it would, and its backward's matmuls come through here too;
- the FLOP audit's dispatch mode and torch.compile's tracing see each op in its own dtype
  (no dispatch mode is added: Dynamo compiles as before);
- Inductor's compiled code calls these ops (`mm.out`, `addmm.out`, ...) when it runs.
Everything else (elementwise ops, norms, the optimizer) keeps PyTorch's kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from runner.precision.caps import DeviceCaps
from runner.precision.modes import mode_of

LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

_aten = torch.ops.aten
_BACKEND_SELECT = torch._C.DispatchKey.BackendSelect
# Flash attention: its logsumexp is fp32 by contract, as an output and as the backward's input.
_FLASH = _aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_FUNCTIONAL = (
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten.convolution.default,
    _aten.convolution_backward.default,
    _FLASH,
    _FLASH_BACKWARD,
)
# The out= forms, which Inductor's generated code calls: computed by their functional form.
_OUT = {
    _aten.mm.out: _aten.mm.default,
    _aten.addmm.out: _aten.addmm.default,
    _aten.bmm.out: _aten.bmm.default,
    _aten.baddbmm.out: _aten.baddbmm.default,
}


class _Computed(threading.local):
    """The dtype of the operands the last op computed here handed PyTorch's kernel (None where
    none did): the precision manifest reads it after each matmul it sees."""

    dtype: torch.dtype | None = None


COMPUTED = _Computed()


def emulated_dtypes(setting: str, caps: DeviceCaps, modes: Iterable[str]) -> frozenset[torch.dtype]:
    """The low-precision dtypes whose matmuls `fast` computes in fp32 for a run in `modes` (its
    stages): none on a GPU or with `native`; with `auto`, those the CPU lacks units for."""
    if caps.type != "cpu" or setting == "native":
        return frozenset()
    # fp8 runs its unconverted layers (and torchao's emulated fp8 matmuls) in bf16 autocast.
    low = {mode_of(m).low_dtype for m in modes}
    return frozenset(
        dtype
        for name, dtype in LOW_DTYPES.items()
        if dtype in low and (setting == "fast" or not caps.support(name)[0])
    )


class FastKernels:
    """While entered, matmul-like ops on CPU tensors of `dtypes` compute in fp32 and round their
    outputs to their dtype; `calls` counts the ops it computed so. Entering with no dtypes
    changes nothing."""

    def __init__(self, dtypes: frozenset[torch.dtype]):
        self.dtypes = dtypes
        self.calls = 0
        self._library: torch.library.Library | None = None

    def __enter__(self) -> FastKernels:
        if self.dtypes and self._library is None:
            library = torch.library.Library("aten", "IMPL")
            for op in _FUNCTIONAL:
                library.impl(op, self._functional(op), "BackendSelect", with_keyset=True)
            for op, functional in _OUT.items():
                library.impl(op, self._out(op, functional), "BackendSelect", with_keyset=True)
            self._library = library
        return self

    def __exit__(self, *exc) -> None:
        if self._library is not None:
            self._library._destroy()  # the ops dispatch as before: nothing stays registered
            self._library = None

    def _dtype(self, op, args: tuple, kwargs: dict) -> torch.dtype | None:
        """The low dtype this call computes in, or None: PyTorch's kernel then runs (and raises
        as it would for mixed dtypes)."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        dtype = tensors[0].dtype
        if dtype not in self.dtypes or tensors[0].device.type != "cpu":
            return None
        allowed = {dtype, torch.float32} if op is _FLASH_BACKWARD else {dtype}
        if any(t.is_floating_point() and t.dtype not in allowed for t in tensors):
            return None
        return dtype

    def _in_fp32(self, op, keyset, dtype: torch.dtype, args: tuple, kwargs: dict):
        self.calls += 1
        args, kwargs = tree_map_only(
            torch.Tensor, lambda t: t.float() if t.dtype == dtype else t, (args, kwargs)
        )
        COMPUTED.dtype = torch.float32  # `_dtype` let through only `dtype` (and fp32) operands
        return op.redispatch(keyset.remove(_BACKEND_SELECT), *args, **kwargs)

    def _functional(self, op) -> Callable:
        def kernel(keyset, *args, **kwargs):
            dtype = self._dtype(op, args, kwargs)
            if dtype is None:
                return op.redispatch(keyset.remove(_BACKEND_SELECT), *args, **kwargs)
            result = self._in_fp32(op, keyset, dtype, args, kwargs)
            if op is _FLASH:
                output, logsumexp = result
                return output.to(dtype), logsumexp
            if isinstance(result, tuple):  # convolution_backward, flash backward: gradients
                return tuple(None if r is None else r.to(dtype) for r in result)
            return result.to(dtype)

        return kernel

    def _out(self, op, functional) -> Callable:
        def kernel(keyset, *args, out, **kwargs):
            dtype = self._dtype(op, args, kwargs)
            if dtype is None or out.dtype != dtype:
                return op.redispatch(keyset.remove(_BACKEND_SELECT), *args, out=out, **kwargs)
            result = self._in_fp32(functional, keyset, dtype, args, kwargs)
            if out.shape != result.shape:
                out.resize_(result.shape)
            return out.copy_(result)

        return kernel
