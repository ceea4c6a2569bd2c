"""`fdx bench throughput --profile`: the step breakdown puts each part where
it belongs. Checked by counting calls, which are exact on every machine,
never by shares of measured time (they move with the load): a logits
processor that calls a known op a known number of times a step shows up
outside with exactly those calls; the composed layers' products are GEMMs
and their attention is attention, one call each a layer; the compiled stack
is one call among the compiled layers, not outside."""
from __future__ import annotations

import time

import pytest

from fdx import LLM
from fdx.entrypoints.bench.throughput import format_throughput, throughput
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import LogitsProcessor
from fdx.core.plugins import PluginManager
from fdx.plugins.backends.attention import FUSED_LAYERS_ENV
from tiny_models import TinyLlama

pytestmark = pytest.mark.slow                   # builds engines on compiled kernels

LAYERS = 3
# a composed layer's products: merged q/k/v, o, merged gate/up, down; and the lm_head a step
GEMMS_PER_STEP = 4 * LAYERS + 1
SLEEPS = 3                                      # calls of time.sleep in each apply


class Sleepy(LogitsProcessor):
    def update_state(self, update):
        pass

    def apply(self, logits):
        for _ in range(SLEEPS):
            time.sleep(0)
        return logits


class SleepyPlugin:
    @hookimpl
    def fdx_register_logits_processors(self, register):
        register("sleepy", Sleepy)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(TinyLlama(vocab=64, hidden=32, heads=4, kv_heads=2, layers=LAYERS, max_len=64)
               .hf_dir(tmp_path_factory.mktemp("profile") / "m"))


def run(path, **kw):
    llm = LLM(path, max_model_len=64, num_kv_blocks=64, block_size=4, progress=False, **kw)
    return throughput(llm, num_requests=4, input_len=8, output_len=6, profile=True)


def assert_parts_add_up(p):
    assert p["profiled_steps"] >= 3 and p["batch"] == 4
    shares = ("gemm_share", "attention_share", "compiled_layers_share", "outside_share")
    assert sum(p[k] for k in shares) == pytest.approx(1.0)


def test_profile_counts_each_part_where_it_belongs(tiny, monkeypatch):
    """On the layer's composed ops (FDX_FUSED_LAYERS=0): one GEMM a linear,
    one attention call a layer, no compiled layer; the processor's sleeps are
    outside, exactly SLEEPS calls a step."""
    monkeypatch.setenv(FUSED_LAYERS_ENV, "0")
    pm = PluginManager()
    pm.add_plugin(SleepyPlugin(), name="sleepy-plugin")
    p = run(tiny, plugins=pm, logits_processors=["sleepy"])["profile"]
    assert_parts_add_up(p)
    assert p["calls_per_step_by_part"] == {"gemm": GEMMS_PER_STEP, "attention": LAYERS, "compiled layers": 0}
    assert p["outside_op_calls_per_step"]["sleep"] == SLEEPS
    assert p["compiled_layers_share"] == 0 and p["gemm_share"] > 0 and p["attention_share"] > 0


def test_profile_counts_the_compiled_stack_as_layers_not_outside(tiny):
    """Fused (the default), a decode step runs all layers in one compiled call
    through ctypes: one call among the compiled layers, the lm_head the one
    GEMM, no attention call of its own; and the report prints the four parts."""
    from test_contracts import cpu_kernel_table
    table = cpu_kernel_table()
    if not table.usable("cpp.decoder_layer"):
        pytest.skip(f"cpp.decoder_layer: {table.why_not('cpp.decoder_layer')}")
    r = run(tiny)
    p = r["profile"]
    assert_parts_add_up(p)
    assert p["calls_per_step_by_part"] == {"gemm": 1, "attention": 0, "compiled layers": 1}
    assert p["compiled_layers_share"] > 0
    assert not any("decoder" in name for name in p["outside_op_calls_per_step"])
    text = format_throughput(r)
    assert "decode-only steps at 4 sequences" in text
    for part in ("GEMMs", "attention", "compiled layers", "outside"):
        assert f"    {part} " in text


def test_profile_charges_matmuls_through_paddles_wrapper(tiny, monkeypatch):
    """On the Paddle path (no compiled kernels) rotary rotates with a small
    matmul in ops/rotary.py and attention multiplies in ops/attention.py,
    and the linears' products are paddle.matmul in ops/dense.py, all through
    paddle.matmul's Python wrapper: the products are GEMMs, one a linear,
    the rotation outside and attention's matmuls attention's."""
    monkeypatch.setenv("FDX_DISABLE_CPP_OPS", "1")
    p = run(tiny)["profile"]
    assert_parts_add_up(p)
    assert p["calls_per_step_by_part"]["gemm"] == GEMMS_PER_STEP
    assert p["calls_per_step_by_part"]["attention"] == LAYERS
    assert p["outside_op_calls_per_step"]["matmul (rotary)"] > 0
