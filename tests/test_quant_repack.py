"""Repacked (row-interleaved) quantized weights and batch-invariant quantized products.

Every kind x every build this CPU runs (portable, avx2, avx512) x the plain and
the interleaved layout (issue 34 items 1-2, issue 40 item 4): the compiled
product ``fdx_quant_matmul`` called directly (the int8 path at every row count,
as ``backend.batch_invariant`` runs it) against a float64 numpy product of the
blocks dequantized by the ``gguf`` package (wint8/4: numpy), with the
activations quantized as the kernels quantize them (``int8_blocks``: per 32, per
256 for the k-quants), so the tolerance is float32 accumulation: 1e-4 of the
largest output. Then bitwise: each row computed alone equals the same row
inside every row count (1, 2, 3, 7, 8, 33, 512). A weight whose rows are not a
multiple of 4 keeps the plain layout; repacking is undone exactly.
"""
from __future__ import annotations

import pathlib
import zlib

import numpy as np
import pytest

from fdx.ops import cpp, quant
from fdx.ops.probes import act_block, int8_blocks, random_quantized
from test_contracts import cpu_kernel_table

ROW_COUNTS = (1, 2, 3, 7, 8, 33, 512)


@pytest.fixture(scope="module")
def module():
    return cpp._module_or_raise()


def _variant_ok(kind: str, variant: str) -> None:
    finding = cpu_kernel_table().findings.get(cpp.quant_kernel_name(kind, variant), "not probed")
    if finding is not None:
        pytest.skip(f"{kind} {variant} does not run here: {finding}")


def _product(module, w: quant.QuantizedTensor, x: np.ndarray, variant: str, code: int | None = None) -> np.ndarray:
    """The compiled product (``code``: the kernel's code bits, batch-invariant by default)."""
    import paddle
    data, scales = w.tensors()
    code = cpp.quant_code(w, invariant=True) if code is None else code
    return module.fdx_quant_matmul(paddle.to_tensor(x), data, scales, code, cpp._VARIANT_CODE[variant],
                                   w.shape[0], w.shape[1], w.group_size).numpy()


@pytest.mark.parametrize("variant", cpp.QUANT_VARIANTS)
@pytest.mark.parametrize("kind", cpp.QUANT_KINDS)
def test_each_layout_and_row_count_against_numpy_and_rows_alone(module, kind, variant):
    _variant_ok(kind, variant)
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{variant}/repack".encode()))
    cols = 512
    x = rng.standard_normal((max(ROW_COUNTS), cols)).astype(np.float32)
    xq = int8_blocks(x, act_block(kind)).astype(np.float64)
    probed = kind in quant.PROBED_REPACK_KINDS      # interleaved where the layout probe chose it: here, forced
    for rows, want_interleaved in ((36, kind in quant.REPACK_KINDS or probed), (38, False)):   # 38 rows: plain
        w = random_quantized(kind, rows, cols, rng)
        values = w.dequantize().astype(np.float64)
        plain = w.data.copy()
        w.prepare(interleave=True if probed else None)
        assert w.interleaved == want_interleaved, (kind, rows)
        if want_interleaved:
            assert not np.array_equal(w.data, plain) and np.array_equal(w.plain_data(), plain)
            assert np.array_equal(w.dequantize(), quant.QuantizedTensor(kind, w.shape, plain, w.scales,
                                                                        w.group_size).dequantize())
        alone = np.concatenate([_product(module, w, x[i:i + 1], variant) for i in range(max(ROW_COUNTS))])
        want = xq @ values.T
        scale = np.abs(want).max()
        assert np.abs(alone - want).max() <= 1e-4 * scale, f"{kind} {variant} {rows} rows"
        for m in ROW_COUNTS:
            got = _product(module, w, x[:m], variant)
            assert got.shape == (m, rows) and got.dtype == np.float32
            bad = np.flatnonzero((got != alone[:m]).any(axis=1))
            assert bad.size == 0, f"{kind} {variant} {rows} rows: rows {bad[:5]} differ from alone at M={m}"


@pytest.mark.parametrize("variant", cpp.QUANT_VARIANTS)
def test_default_path_at_many_rows_against_numpy(module, variant):
    """The default (not batch-invariant) code at every row count: from 12 rows the
    kinds with blocks of 32 take the AVX-512 VNNI tiles where the CPU has them
    (issue 34 item 3: prefill without dequantizing), another order of the float
    sums than below 12 rows, so the check is numpy's at 1e-4, and bitwise only
    among the row counts on one side (a row's bits do not depend on its tile).
    The k-quants, q4_1 and q5_1 take their VNNI tiles at every row count there;
    their 256-bit path (an AVX-512 CPU without VNNI) is checked too (kCodeRowTiles)."""
    import paddle
    _variant_ok("q8_0", variant)                            # one build for every kind
    rng = np.random.default_rng(zlib.crc32(f"{variant}/many".encode()))
    for kind in cpp.QUANT_KINDS:
        n = 256 if kind.endswith("_k") else 384 if kind == "wint4" else 352   # 11 blocks: an odd last pair
        x = rng.standard_normal((max(ROW_COUNTS), n)).astype(np.float32)
        xq = int8_blocks(x, act_block(kind)).astype(np.float64)
        for rows in (36, 38):                               # interleaved where repacked, plain
            w = random_quantized(kind, rows, n, rng).prepare(True if kind in quant.PROBED_REPACK_KINDS else None)
            want = xq @ w.dequantize().astype(np.float64).T
            data, scales = w.tensors()
            got = {m: module.fdx_quant_matmul(paddle.to_tensor(x[:m]), data, scales, cpp.quant_code(w),
                                              cpp._VARIANT_CODE[variant], rows, n, w.group_size).numpy()
                   for m in ROW_COUNTS}
            for m, g in got.items():
                assert np.abs(g - want[:m]).max() <= 1e-4 * np.abs(want).max(), f"{kind} {variant} {rows} M={m}"
            many = got[512]
            if variant == "avx2" and kind.endswith("_k") and (cpp.QUANT_AVX2_PANEL_MIN_ROWS.get(kind) or 0) > 33:
                # the AVX2 panel product from its threshold has other bits than OctMatmulK below it
                many = module.fdx_quant_matmul(paddle.to_tensor(x), data, scales, cpp.quant_code(w) | cpp._CODE_NO_PANEL,
                                               cpp._VARIANT_CODE[variant], rows, n, w.group_size).numpy()
            assert np.array_equal(got[33], many[:33]), f"{kind} {variant} {rows}: 33 rows vs 512"
            assert np.array_equal(got[7], got[8][:7]) and np.array_equal(got[1], got[2][:1]), f"{kind} {variant}"
            if (kind.endswith("_k") or kind in ("q4_1", "q5_1") or w.interleaved and kind in ("q4_0", "wint4")) \
                    and variant == "avx512":
                # the 256-bit path, which an AVX-512 CPU without VNNI takes (here: the VNNI tiles)
                code = cpp.quant_code(w) | cpp._CODE_ROW_TILES
                old = {m: module.fdx_quant_matmul(paddle.to_tensor(x[:m]), data, scales, code,
                                                  cpp._VARIANT_CODE[variant], rows, n, w.group_size).numpy()
                       for m in (1, 7, 33)}
                for m, g in old.items():
                    assert np.abs(g - want[:m]).max() <= 1e-4 * np.abs(want).max(), f"{kind} 256-bit {rows} M={m}"
                assert np.array_equal(old[1], old[7][:1]) and np.array_equal(old[7], old[33][:7]), kind


def test_take_rows_and_embedding_read_the_interleaved_layout():
    rng = np.random.default_rng(3)
    for kind in ("q8_0", "q4_k"):                 # both in REPACK_KINDS
        w = random_quantized(kind, 16, 256, rng)
        ref = w.dequantize()
        w.prepare()
        assert w.interleaved
        idx = np.array([5, 0, 15, 6])
        assert np.array_equal(w.take_rows(idx).dequantize(), ref[idx])
        assert np.array_equal(quant.embedding(idx, w).numpy(), ref[idx])


# --- the layout chosen per machine (q4_0, wint4, q2_k, q3_k) ----------------------------------------

def test_the_layout_of_q4_0_and_wint4_follows_the_probe_of_the_build_that_runs(monkeypatch):
    from fdx.core import kernels
    monkeypatch.delenv("FDX_REPACK", raising=False)
    rng = np.random.default_rng(5)
    for kind in quant.PROBED_REPACK_KINDS:
        for finding, build, want in ((None, "avx2", True), ("the plain layout is faster here", "avx2", False),
                                     (None, "portable", True)):
            table = kernels.KernelTable({cpp.quant_kernel_name(kind, "portable"): None,
                                         cpp.quant_kernel_name(kind, build): None,
                                         quant.interleave_kernel_name(kind, build): finding,
                                         # another build's choice, not the one that runs, says the opposite
                                         quant.interleave_kernel_name(kind, "avx512"): None if finding else "slower"})
            with kernels.using(table):
                w = random_quantized(kind, 8, 256, rng).prepare()
            assert w.interleaved == want, (kind, finding, build)
        with kernels.using(kernels.REFERENCE):          # nothing probed: plain
            assert not random_quantized(kind, 8, 256, rng).prepare().interleaved
    monkeypatch.setenv("FDX_REPACK", "all")
    assert random_quantized("q4_0", 8, 256, rng).prepare().interleaved


def test_the_layout_probe_checks_the_product_and_reports_its_choice(monkeypatch):
    """Each build's layout probe that this CPU runs: its interleaved product
    against numpy passes (else its finding would be a wrong result), so the
    finding is either the choice (None) or the plain layout's measured win; the
    backend's kernel line names the layout of each kind. (The probe run here
    times a 1024 x 2048 weight, not INTERLEAVE_PROBE_SHAPE's 16384 x 2048: the
    same code and checks, a sixteenth of the portable build's 5 s of timing.)"""
    from fdx.ops import probes
    monkeypatch.setattr(probes, "INTERLEAVE_PROBE_SHAPE", (1024, 2048))
    from fdx.plugins.backends import cpu
    table = cpu_kernel_table()
    assert set(cpu.LAYOUT_KERNELS) == {quant.interleave_kernel_name(k, v) for k in quant.PROBED_REPACK_KINDS
                                       for v in cpp.QUANT_VARIANTS} <= set(cpu.KERNELS)
    for name in cpu.LAYOUT_KERNELS:
        matmul = name.replace("_interleave", "_matmul")
        if table.usable(matmul):
            finding = table[name]
            assert finding is None or finding.startswith("the plain layout is faster here"), (name, finding)
    line = cpu.op_choices(table)["quant_layout"]
    for kind in quant.PROBED_REPACK_KINDS:
        assert f"{kind}=interleaved" in line or f"{kind}=plain" in line, line
    finding = probes.run(["cpp.q4_0_interleave"])["cpp.q4_0_interleave"]     # in this process: portable
    assert finding is None or finding.startswith("the plain layout is faster here"), finding


def test_a_file_mapping_is_read_once_into_the_one_interleaved_buffer(tmp_path):
    """A weight held as a read-only view of a file (a GGUF memmap) is repacked into
    one new buffer, and the file's pages under it leave the resident set as they
    are copied (one copy resident, not two); a writable one is repacked in place."""
    rng = np.random.default_rng(6)
    w = random_quantized("q4_0", 1024, 2048, rng)       # 2.3 MB
    plain = w.data.copy()
    path = tmp_path / "blocks.bin"
    plain.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=plain.shape)

    def resident_kib() -> int:
        import mmap
        import re
        # the mapping's own Rss line in smaps: pages of the file this process holds
        text = pathlib.Path("/proc/self/smaps").read_text()
        start = mapped.ctypes.data - mapped.ctypes.data % mmap.PAGESIZE
        for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
            lo, hi = (int(v, 16) for v in block.split(None, 1)[0].split("-"))
            if lo <= start < hi:
                return int(re.search(r"^Rss:\s+(\d+) kB", block, re.M).group(1))
        return 0

    mapped.sum()                                        # read: every page resident
    assert resident_kib() >= plain.nbytes // 1024 - 8
    q = quant.QuantizedTensor("q4_0", w.shape, mapped).prepare(interleave=True)
    assert q.interleaved and q.data.flags.writeable and not np.shares_memory(q.data, mapped)
    assert resident_kib() <= 8, "the file's pages stayed resident beside the repacked copy"
    assert np.array_equal(q.plain_data(), plain) and np.array_equal(np.asarray(mapped), plain)
    own = random_quantized("q4_1", 64, 256, rng)
    buffer = own.data
    own.prepare()
    assert own.interleaved and own.data is buffer                          # in place
    assert own.tensors()[0].data_ptr() == buffer.ctypes.data               # the kernels read that buffer


@pytest.fixture(scope="module")
def q4_0_file(tmp_path_factory):
    from test_weight_formats import T, quantized_gguf, tiny_llama
    model = tiny_llama(tie=False, seed=41)
    return quantized_gguf(tmp_path_factory.mktemp("repack") / "q4_0.gguf", model, lambda n: T.Q4_0)


def test_engine_greedy_on_a_q4_0_file_is_the_same_interleaved_or_plain(q4_0_file, monkeypatch):
    """The whole engine on a tiny Q4_0 GGUF, its weights plain (FDX_REPACK=0) and
    interleaved (FDX_REPACK=all): the same greedy tokens, batched and alone."""
    from fdx import LLM
    from test_weight_formats import GREEDY, TINY, prompts
    batch = prompts(3)
    got = {}
    for setting in ("0", "all"):
        monkeypatch.setenv("FDX_REPACK", setting)
        llm = LLM(str(q4_0_file), quantization="auto", **TINY)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
        alone = llm.generate([{"prompt_token_ids": batch[1]}], GREEDY)
        held = [m.q for m in _block_weights(llm.engine.model)]
        assert held and {q.kind for q in held} == {"q4_0"}
        assert any(q.interleaved for q in held) == (setting == "all"), setting
        got[setting] = [o.outputs[0].token_ids for o in outs]
        assert alone[0].outputs[0].token_ids == got[setting][1]
        del llm
    assert got["0"] == got["all"]


def _block_weights(model):
    from fdx.plugins.models.weight_formats import BlockWeight
    seen, out, stack = set(), [], [model]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or not hasattr(obj, "__dict__"):
            continue
        seen.add(id(obj))
        if isinstance(obj, BlockWeight):
            out.append(obj)
            continue
        for v in vars(obj).values():
            stack.extend(v if isinstance(v, (list, tuple)) else [v])
    return out


@pytest.mark.parametrize("variant", cpp.QUANT_VARIANTS)
@pytest.mark.parametrize("kind", cpp.QUANT_KINDS)
def test_no_activation_rows_give_an_empty_product_in_every_layout_and_path(module, kind, variant):
    """A step can ask for a product of 0 rows (no row of it needs logits: the LM head of a
    chunked prefill's middle step). Every kind, both layouts, the default path, the
    batch-invariant one and the panel forced: an empty [0, rows] result, no read of a
    row that is not there (the few-row q8_0 VNNI tile once read its first row's pointer
    and died by SIGSEGV: test_decoder_layer's greedy q8_0 runs)."""
    _variant_ok(kind, variant)
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{variant}/empty".encode()))
    x = np.zeros((0, 256), np.float32)
    for rows in (36, 38):                                   # interleaved where the kind repacks, plain
        w = random_quantized(kind, rows, 256, rng)
        w.prepare(interleave=True if kind in quant.PROBED_REPACK_KINDS else None)
        for code in (cpp.quant_code(w), cpp.quant_code(w, invariant=True), cpp.quant_code(w) | cpp._CODE_PANEL):
            got = _product(module, w, x, variant, code)
            assert got.shape == (0, rows), (kind, variant, rows, code)
