"""`fdx bench throughput --profile`: the step breakdown finds time where it
was put. A logits processor that sleeps a known time each step must show
up in the outside share, in the sampling phase and as `sleep`, and the
three shares must add up to the step."""
from __future__ import annotations

import time

import pytest

from fdx import LLM
from fdx.core.bench.throughput import format_throughput, throughput
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import LogitsProcessor
from fdx.core.plugins import PluginManager
from fdx.plugins.backends.attention import FUSED_LAYERS_ENV

SLEEP_S = 0.03


class Sleepy(LogitsProcessor):
    def update_state(self, update):
        pass

    def apply(self, logits):
        time.sleep(SLEEP_S)
        return logits


class SleepyPlugin:
    @hookimpl
    def fdx_register_logits_processors(self, register):
        register("sleepy", Sleepy)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return str(tiny_checkpoints["Qwen3ForCausalLM"][0])


def run(path, **kw):
    llm = LLM(path, max_model_len=64, num_kv_blocks=64, block_size=4, progress=False, **kw)
    return throughput(llm, num_requests=4, input_len=8, output_len=6, profile=True)


def test_profile_puts_a_known_cost_where_it_belongs(tiny, monkeypatch):
    """On the layer's composed ops (FDX_FUSED_LAYERS=0: fused, a step's products
    and attention are one compiled call, in neither share)."""
    monkeypatch.setenv(FUSED_LAYERS_ENV, "0")
    pm = PluginManager()
    pm.add_plugin(SleepyPlugin(), name="sleepy-plugin")
    plain = run(tiny, plugins=pm)["profile"]
    slow = run(tiny, plugins=pm, logits_processors=["sleepy"])["profile"]
    for p in (plain, slow):
        assert p["profiled_steps"] >= 3 and p["batch"] == 4
        assert p["gemm_share"] > 0 and p["attention_share"] > 0
        assert p["gemm_share"] + p["attention_share"] + p["outside_share"] == pytest.approx(1.0)
    sleep_ms = 1000 * SLEEP_S
    assert slow["outside_ops_ms_per_step"]["sleep"] == pytest.approx(sleep_ms, rel=0.5)
    assert "sleep" not in plain["outside_ops_ms_per_step"]
    sampling = "sampling (processors + sampler)"
    assert slow["outside_phases_ms_per_step"][sampling] - plain["outside_phases_ms_per_step"][sampling] \
        == pytest.approx(sleep_ms, rel=0.5)
    # the outside time grew by the sleep, step for step
    grew = slow["mean_step_ms"] * slow["outside_share"] - plain["mean_step_ms"] * plain["outside_share"]
    assert grew == pytest.approx(sleep_ms, rel=0.5)


def test_profile_names_the_one_call_for_all_layers(tiny):
    """Fused (the default), the tiny Qwen3's decode steps run all layers in one
    compiled call, through ctypes: the profile lists its time among the ops."""
    from test_contracts import cpu_kernel_table
    table = cpu_kernel_table()
    if not table.usable("cpp.decoder_layer"):
        pytest.skip(f"cpp.decoder_layer: {table.why_not('cpp.decoder_layer')}")
    p = run(tiny)["profile"]
    assert p["outside_ops_ms_per_step"]["compiled fdx_decoder_stack"] > 0
    assert p["attention_share"] == 0


def test_profile_report_is_printed(tiny):
    r = run(tiny)
    text = format_throughput(r)
    assert "decode-only steps at 4 sequences" in text and "GEMMs" in text and "outside" in text


def test_profile_charges_matmuls_through_paddles_wrapper(tiny, monkeypatch):
    """On the Paddle path (no compiled kernels) rotary rotates with a small
    matmul in ops/ and attention multiplies in ops/attention.py, both through
    paddle.matmul's Python wrapper: the first is outside time, the second
    attention's, and neither may count as a GEMM."""
    monkeypatch.setenv("FDX_DISABLE_CPP_OPS", "1")
    p = run(tiny)["profile"]
    assert p["outside_ops_ms_per_step"]["matmul (inside ops/)"] > 0
    assert p["gemm_share"] + p["attention_share"] + p["outside_share"] == pytest.approx(1.0)
    assert p["outside_share"] > 0
