"""The product threads' memory read rate (fdx.ops.cpp.read_bandwidth), which
batch-1 decode follows and `fdx bench throughput` records beside its figures
(docs/backends.md, "Batch-1 decode and memory bandwidth")."""
from __future__ import annotations

import pytest

from fdx.ops import cpp

pytestmark = pytest.mark.skipif(not cpp.available(), reason=f"compiled kernels: {cpp.unavailable_reason()}")


@pytest.mark.parametrize("threads", [1, 2])
def test_read_bandwidth_is_a_rate_memory_can_be_read_at(threads):
    """Between 0.5 and 2000 GB/s, best of 3 rounds: a call that read nothing
    (or timed nothing) gives 0 or a rate far above any memory's."""
    for mib in (8, 32):
        assert 0.5 < cpp.read_bandwidth(threads, mib=mib, rounds=3) < 2000
    assert 0.5 < cpp.read_bandwidth(threads, mib=8, rounds=3, own_process=True) < 2000   # from a child


def test_the_benchs_read_rate_buffer_is_not_on_the_callers_peak_memory():
    """`fdx bench throughput` reads the rate from a child process: its 128 MiB
    buffer would otherwise sit on top of the run's peak (what `/usr/bin/time`
    reports for the run: issue 34 item 4's figure)."""
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss          # KiB
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    mib = (before - rss) // 1024 + 64             # more than the headroom under this process's peak
    assert cpp.read_bandwidth(1, mib=mib, rounds=1, own_process=True) > 0.5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 16 * 1024


def test_bench_throughput_reports_the_read_rate_around_the_run(tmp_path):
    """`fdx bench throughput` on the CPU backend reads the rate just before and
    after the timed steps and prints both."""
    from fdx import LLM
    from fdx.entrypoints.bench.throughput import format_throughput, throughput
    from tiny_models import TinyLlama
    path = str(TinyLlama(vocab=64, hidden=32, heads=4, kv_heads=2, layers=2, max_len=64).hf_dir(tmp_path / "m"))
    llm = LLM(path, max_model_len=64, num_kv_blocks=32, block_size=4, progress=False)
    r = throughput(llm, num_requests=1, input_len=4, output_len=3)
    before, after = r["memory_read_gbps"]
    assert before > 0.5 and after > 0.5
    assert f"memory read      {before:.1f} GB/s before, {after:.1f} after" in format_throughput(r)
