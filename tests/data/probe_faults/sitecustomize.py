"""Fault injection for the kernel-probe tests, loaded by the probe child
through PYTHONPATH: FDX_TEST_FAULTS="kernel=sigill,kernel=wrong" replaces
each named kernel's callable before any probe runs. ``sigill`` kills the
process with a real SIGILL when the kernel is called (what a kernel built
for a missing instruction set does); ``wrong`` returns the real result
times 1.01. A quantized product (``cpp.<kind>_matmul[.<isa>]``) is
replaced in fdx.ops.quant.KERNELS, where its probe finds it. FDX_TEST_PROBE_LOG, if set, gets one line per child started.
FDX_TEST_INTERLEAVE_SHAPE="ROWSxCOLS", if set, is the weight the layout probes
(cpp.<kind>_interleave[.<isa>]) time in place of fdx.ops.probes.INTERLEAVE_PROBE_SHAPE:
their interleaved product is still checked against numpy, and the timing (which
test_kernel_table never compares: a layout is a measured choice) takes a sixteenth
of the time.
"""
import os

if os.environ.get("FDX_TEST_INTERLEAVE_SHAPE"):
    import fdx.ops.probes as _probes
    _probes.INTERLEAVE_PROBE_SHAPE = tuple(int(n) for n in os.environ["FDX_TEST_INTERLEAVE_SHAPE"].split("x"))

_faults = [f.split("=", 1) for f in os.environ.get("FDX_TEST_FAULTS", "").split(",") if "=" in f]
if os.environ.get("FDX_TEST_PROBE_LOG"):
    with open(os.environ["FDX_TEST_PROBE_LOG"], "a") as _log:
        _log.write(f"child {os.getpid()}\n")
if _faults:
    import importlib
    import signal

    _TARGETS = {"fused_rms_norm": ("paddle.incubate.nn.functional", "fused_rms_norm"),
                "swiglu": ("paddle.nn.functional", "swiglu")}

    def _faulty(real, kind: str):
        def faulty(*args, **kwargs):
            if kind == "sigill":
                os.kill(os.getpid(), signal.SIGILL)
            out = real(*args, **kwargs)
            if isinstance(out, tuple):
                return (out[0] * 1.01,) + tuple(out[1:])
            return out * 1.01
        return faulty

    def _patch(kernel: str, kind: str) -> None:
        if "_matmul" in kernel:
            quant = importlib.import_module("fdx.ops.quant")
            q = kernel.removeprefix("cpp.").split("_matmul")[0]
            quant.KERNELS[q] = tuple((name, _faulty(fn, kind) if name == kernel else fn)
                                     for name, fn in quant.KERNELS[q])
            return
        module_name, attr = _TARGETS.get(kernel) or ("fdx.ops.cpp", kernel.removeprefix("cpp."))
        module = importlib.import_module(module_name)
        setattr(module, attr, _faulty(getattr(module, attr), kind))

    for _kernel, _kind in _faults:
        _patch(_kernel, _kind)
