"""`fdx bench peers` without building llama.cpp: its parser against a real
llama-batched-bench output, its figures and ratios against a brute-force
recompute, the machine probes, the server stop, the one-line errors, --help."""
from __future__ import annotations

import io
import json
import math
import os
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from fdx.entrypoints.bench import load_peers

peers = load_peers()                    # scripts/bench_peers/fdx_bench_peers.py, outside the runtime package

DATA = Path(__file__).parent / "data"


def test_parser_reads_the_real_llama_batched_bench_output():
    """tests/data/llama_batched_bench_B8.txt is what llama-batched-bench printed
    (stdout and stderr) here; each row must agree with its own times."""
    text = (DATA / "llama_batched_bench_B8.txt").read_text()
    rows = peers.parse_batched_bench(text)
    assert len(rows) == 1
    r = rows[0]
    assert (r["pp"], r["tg"], r["b"]) == (128, 128, 8)
    assert r["n_kv"] == r["b"] * (r["pp"] + r["tg"])
    # rates recomputed from the printed times (3 decimals): prompt, decode, all
    assert r["s_pp"] == pytest.approx(r["b"] * r["pp"] / r["t_pp"], rel=0.01)
    assert r["s_tg"] == pytest.approx(r["b"] * r["tg"] / r["t_tg"], rel=0.01)
    assert r["s"] == pytest.approx(r["n_kv"] / r["t"], rel=0.01)
    assert r["t"] == pytest.approx(r["t_pp"] + r["t_tg"], abs=0.01)
    fig = peers.llama_figures(r)
    assert (fig["prompt_tps"], fig["decode_tps"], fig["all_tps"]) == (r["s_pp"], r["s_tg"], r["s"])


def test_parser_reads_several_rows_and_rejects_a_missing_table():
    text = (DATA / "llama_batched_bench_B8.txt").read_text().splitlines()
    i = next(k for k, line in enumerate(text) if "S_PP t/s" in line)
    header, rule, row = text[i], text[i + 1], text[i + 2]
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    cells[2] = "16"                                             # a second row, B=16
    two = "\n".join(["main: noise", header, rule, row, "| " + " | ".join(cells) + " |", "llama_perf: done"])
    rows = peers.parse_batched_bench(two)
    assert [r["b"] for r in rows] == [8, 16]
    with pytest.raises(peers.PeerError, match="no result table"):
        peers.parse_batched_bench("error: failed to load model\n")


def test_fdx_figures_match_the_throughput_json():
    """tests/data/fdx_throughput_B8.json is fdx bench throughput --json on the same
    F32 file; all tok/s is (prompt + output) / wall, as llama-batched-bench's S."""
    d = json.loads((DATA / "fdx_throughput_B8.json").read_text())
    fig = peers.fdx_figures(d)
    assert fig["all_tps"] == pytest.approx((8 * 128 + d["output_tokens"]) / d["total_time_s"])
    assert d["output_tokens"] == 8 * 128
    assert fig["prompt_tps"] == d["prompt_tokens_per_s"] and fig["decode_tps"] == d["decode_tokens_per_s"]


def _figures(rng) -> dict:
    return {k: float(rng.uniform(1, 500)) for k in ("prompt_tps", "decode_tps", "all_tps", "total_s")}


def test_rows_ratios_and_table_against_a_recompute():
    rng = np.random.default_rng(3)
    rows = []
    for b in (1, 8, 32, 64):
        ll, fx = _figures(rng), _figures(rng)
        row = peers.batch_row(b, ll, fx)
        for k in ("prompt_tps", "decode_tps", "all_tps"):
            assert row["ratio"][k] == pytest.approx(fx[k] / ll[k])
        rows.append(row)
    ll_s = {"output_tps": 101.4, "median_ttft_ms": 6800.0, "median_tpot_ms": 265.0}
    fx_s = {"output_tps": 87.5, "median_ttft_ms": 8700.0, "median_tpot_ms": 298.0}
    serve = {"num_requests": 64, "concurrency": 32, **peers.serve_row(ll_s, fx_s)}
    assert serve["ratio"]["output_tps"] == pytest.approx(87.5 / 101.4)
    assert serve["ratio"]["median_ttft_ms"] == pytest.approx(8700 / 6800)
    machine = {"cpu": "Test CPU", "cores": 2, "threads": 2, "sgemm_gflops": 110.0, "memory_read_gbps": 5.0,
               "load_avg_1m": 1.0}
    report = {"input_len": 128, "output_len": 128, "model": "m.F32.gguf", "machine": machine,
              "batches": rows, "serve": serve}
    table = peers.format_table(report)
    assert "Test CPU, 2 cores (2 threads used), sgemm 110 GFLOP/s, memory read 5.0 GB/s" in table
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    for row, line in zip(rows, lines[1:]):                      # after the header line
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert int(cells[0]) == row["batch"]
        for j, k in ((1, "prompt_tps"), (4, "decode_tps"), (7, "all_tps")):
            ll, fx = float(cells[j]), float(cells[j + 1])
            assert ll == pytest.approx(row["llama"][k], abs=0.05) and fx == pytest.approx(row["fdx"][k], abs=0.05)
            assert float(cells[j + 2].rstrip("x")) == pytest.approx(row["fdx"][k] / row["llama"][k], abs=0.005)
    assert "| fdx / llama | 0.86x | 1.28x | 1.12x |" in table
    assert peers._ratio(1.0, 0.0) is None and peers._ratio(None, 2.0) is None


def test_repeats_keep_the_best_run_of_each_side():
    rng = np.random.default_rng(5)
    llama_runs, fdx_runs = [_figures(rng) for _ in range(3)], [_figures(rng) for _ in range(3)]
    row = peers.batch_row(32, peers.best_run(llama_runs), peers.best_run(fdx_runs))
    best_l = llama_runs[int(np.argmax([r["all_tps"] for r in llama_runs]))]
    best_f = fdx_runs[int(np.argmax([r["all_tps"] for r in fdx_runs]))]
    assert row["llama"]["prompt_tps"] == best_l["prompt_tps"] and row["fdx"]["decode_tps"] == best_f["decode_tps"]
    assert row["ratio"]["all_tps"] == pytest.approx(best_f["all_tps"] / best_l["all_tps"])
    assert row["fdx"]["all_tps_runs"] == [r["all_tps"] for r in fdx_runs]
    machine = {"cpu": "c", "cores": 2, "threads": 2, "sgemm_gflops": 1.0, "memory_read_gbps": 1.0}
    table = peers.format_table({"input_len": 1, "output_len": 1, "model": "m", "machine": machine,
                                "batches": [row]})
    assert f"B=32: best of 3 runs each; all tok/s of every run: llama.cpp {llama_runs[0]['all_tps']:.1f}, " in table


@pytest.mark.slow
def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(0)
    rows = [peers.batch_row(b, _figures(rng), _figures(rng)) for b in (1, 8)]
    report = {"input_len": 128, "output_len": 128, "batches": rows,
              "machine": {"cpu": "x", "threads": 2}}
    peers.plot(report, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_machine_probes_give_sane_positive_numbers():
    m = peers.machine_info(2, quick=True)
    assert m["cpu"] and m["cores"] >= 1 and m["threads"] == 2
    assert 0.1 < m["sgemm_gflops"] < 1e5                   # a CPU does 0.1 to 100k GFLOP/s fp32
    assert 0.05 < m["memory_read_gbps"] < 1e4
    assert math.isfinite(m["load_avg_1m"]) and m["load_avg_1m"] >= 0


@pytest.mark.slow
def test_help_lists_every_default():
    out = subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "bench", "peers", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    p = peers.build_parser()
    flags = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 12
    for a in flags:
        assert "default" in a.help, a.option_strings
        assert a.option_strings[0] in out.stdout
    assert "(default: 1,8,32,64)" in " ".join(out.stdout.split())


def _env(tmp_path, path: str) -> dict:
    env = dict(os.environ, FDX_CACHE_DIR=str(tmp_path / "cache"), PATH=path)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return env


@pytest.mark.slow
def test_missing_cmake_is_one_line(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    out = subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "bench", "peers", "--skip-serve"],
                         capture_output=True, text=True, timeout=120, env=_env(tmp_path, str(empty)))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "fdx bench peers: error: building llama.cpp needs cmake and c++ on PATH (for example: apt-get install cmake g++)"]


def _fake_sdist(path: Path, cmakelists: str) -> None:
    with tarfile.open(path, "w:gz") as tar:
        data = cmakelists.encode()
        info = tarfile.TarInfo(f"llama_cpp_python-{peers.LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/CMakeLists.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


@pytest.mark.skipif(not (os.path.exists("/usr/bin/cmake") or __import__("shutil").which("cmake")),
                    reason="needs cmake")
@pytest.mark.slow
def test_a_failed_build_is_one_line_with_the_log(tmp_path):
    """A real cmake run on a source tree whose CMakeLists.txt fails."""
    sdist = tmp_path / peers.SDIST_NAME
    _fake_sdist(sdist, 'cmake_minimum_required(VERSION 3.14)\nproject(x C)\nmessage(FATAL_ERROR "broken on purpose")\n')
    out = subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "bench", "peers", "--skip-serve",
                          "--llama-sdist", str(sdist)],
                         capture_output=True, text=True, timeout=120, env=_env(tmp_path, os.environ["PATH"]))
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in out.stderr
    assert errors[0].startswith("fdx bench peers: error: configuring llama.cpp (cmake) failed (exit code 1); "
                                "the log is ")
    log = Path(errors[0].rsplit("the log is ", 1)[1])
    assert "broken on purpose" in log.read_text()
    # a sdist without vendor/llama.cpp is named as such
    other = tmp_path / "other.tar.gz"
    with tarfile.open(other, "w:gz") as tar:
        info = tarfile.TarInfo("x/README")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(peers.PeerError, match="holds no"):
        peers.extract_llama_cpp(other, tmp_path / "src2")


def test_bad_batch_sizes_name_the_flag():
    with pytest.raises(ValueError, match="--batch-sizes"):
        peers._batch_sizes("1,x")
    with pytest.raises(ValueError, match="--batch-sizes"):
        peers._batch_sizes("0,8")
    assert peers._batch_sizes("1, 8,32") == [1, 8, 32]


_SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                         # a zombie is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_managed_server_stops_its_whole_group_and_frees_the_port(tmp_path):
    port = peers.free_port()
    log = tmp_path / "srv.log"
    srv = peers.ManagedServer("toy", [sys.executable, "-c", _SERVER, str(port)], port, log)
    with srv:
        srv.wait_ready(30)
        leader = srv.proc.pid
        child = int(log.read_text().strip().splitlines()[-1])
        assert _alive(child) and peers._port_open(port)
    assert not _alive(leader) and not _alive(child)
    assert not peers._port_open(port)
    with socket.socket() as s:                   # the port is free again (for a server: SO_REUSEADDR
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # past the TIME_WAIT of old connections)
        s.bind(("127.0.0.1", port))
        s.listen()
    # an error inside the block stops it too
    port = peers.free_port()
    with pytest.raises(RuntimeError):
        with peers.ManagedServer("toy", [sys.executable, "-c", _SERVER, str(port)], port, log) as srv:
            srv.wait_ready(30)
            leader = srv.proc.pid
            raise RuntimeError("boom")
    assert not _alive(leader) and not peers._port_open(port)


@pytest.mark.slow
def test_a_server_that_exits_early_is_a_clear_error(tmp_path):
    port = peers.free_port()
    with peers.ManagedServer("toy", [sys.executable, "-c", "import sys; sys.exit(3)"], port,
                             tmp_path / "x.log") as srv:
        with pytest.raises(peers.PeerError, match="toy exited with code 3 before it was ready"):
            srv.wait_ready(30)
    t0 = time.monotonic()
    with peers.ManagedServer("toy", [sys.executable, "-c", "import time; time.sleep(60)"], port,
                             tmp_path / "y.log") as srv:
        with pytest.raises(peers.PeerError, match="not ready after 1 s"):
            srv.wait_ready(1)
    assert time.monotonic() - t0 < 30


def test_a_failed_tool_is_named_by_its_error_line_not_its_backtrace():
    crash = ("common.cpp:2158: get_sub_batch: failed to add token 33266 at index 12 (error -1, n = 16)\n"
             "30\t../sysdeps/unix/sysv/linux/wait4.c: No such file or directory.\n"
             "360\t../csu/libc-start.c: No such file or directory.\n")
    assert peers._tail(crash).startswith("common.cpp:2158: get_sub_batch: failed to add token")
    assert peers._tail("loading\nall went wrong here\n") == "all went wrong here"
    assert peers._tail("") == "no output"


# -- --quant: the same comparison on each quantized GGUF type ------------------------------------

def test_quant_types_are_checked_and_named_by_the_flag():
    assert peers.quant_types("q4_1, Q8_0,q4_k_m,Q8_0") == ["Q4_1", "Q8_0", "Q4_K_M"]
    for bad in ("", "Q3_X", "F32,IQ2"):
        with pytest.raises(ValueError, match="--quant"):
            peers.quant_types(bad)
    assert peers.fdx_quant_args("F32") == ["--quantization", "none"]
    assert peers.fdx_quant_args("Q4_K_M") == ["--quantization", "auto"]


@pytest.mark.slow
def test_a_file_already_of_the_type_is_used_as_it_is(tmp_path):
    """The embedded SmolLM2 is a Q4_1 file (general.file_type 3): --quant Q4_1
    compares on it, with no llama-quantize run (the binary need not exist)."""
    from fdx.model_io.loader import default_model_path
    model = Path(default_model_path())
    assert peers.gguf_file_type(model) == peers._FILE_TYPES["Q4_1"]
    assert peers.make_quant(tmp_path / "no-such-llama-quantize", model, "Q4_1", root=tmp_path) == model


@pytest.mark.slow
def test_other_types_are_quantized_from_the_f32_file_once(tmp_path):
    """A stand-in llama-quantize (llama.cpp is not built in CI) that logs its
    arguments: Q8_0 is made from the F32 file, which is made from the source,
    and both are cached."""
    from fdx.model_io.loader import default_model_path
    model = Path(default_model_path())
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "llama-quantize"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nfor a; do prev2=$prev; prev=$out; out=$a; done\n'
                    f'cp "$prev2" "$prev"\n')
    fake.chmod(0o755)
    out = peers.make_quant(fake, model, "Q8_0", root=tmp_path)
    assert out.name == "SmolLM2-135M-Instruct.Q8_0.gguf" and out.is_file()
    lines = calls.read_text().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"--allow-requantize {model} ") and lines[0].endswith(" F32")
    f32 = out.with_name("SmolLM2-135M-Instruct.F32.gguf")
    assert f32.is_file() and lines[1].startswith(f"{f32} ") and lines[1].endswith(" Q8_0")
    assert peers.make_quant(fake, model, "Q8_0", root=tmp_path) == out
    assert len(calls.read_text().splitlines()) == 2                 # cached: no third run


def test_the_table_has_a_section_per_type():
    rng = np.random.default_rng(7)
    types = [{"type": k, "model": f"m.{k}.gguf", "fdx_args": peers.fdx_quant_args(k),
              "batches": [peers.batch_row(b, _figures(rng), _figures(rng)) for b in (1, 64)]}
             for k in ("Q4_1", "Q8_0")]
    machine = {"cpu": "c", "cores": 2, "threads": 2, "sgemm_gflops": 1.0, "memory_read_gbps": 1.0}
    table = peers.format_table({"input_len": 8, "output_len": 8, "machine": machine, "types": types,
                                "batches": types[0]["batches"], "model": "m.Q4_1.gguf"})
    assert "Q4_1: m.Q4_1.gguf (fdx --quantization auto)" in table
    assert "Q8_0: m.Q8_0.gguf (fdx --quantization auto)" in table
    rows = [line for line in table.splitlines() if line.startswith("| 64 |")]
    assert len(rows) == 2
    for t, line in zip(types, rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[4]) == pytest.approx(t["batches"][1]["llama"]["decode_tps"], abs=0.05)


# -- --shape: random-weight checkpoints of named real shapes ------------------------------------

models = peers.peer_models

# the parameter counts the models' cards publish
PUBLISHED = {"smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120, "smollm2-1.7b": 1_711_376_384,
             "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-3b": 3_085_938_688,
             "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
             # Qwen3-30B-A3B (30,532,122,624: the model card's 30.5B) with 4 of its 48 layers (623,120,640 each)
             "qwen3-30b-a3b-4l": 30_532_122_624 - 44 * 623_120_640}


def test_every_shape_has_the_published_parameter_count():
    assert set(PUBLISHED) == set(models.SHAPES)
    for name, sh in models.SHAPES.items():
        assert sh.num_parameters() == PUBLISHED[name], name
    with pytest.raises(ValueError, match="--shape 'gpt-5'.*smollm2-135m"):
        models.shape("gpt-5")


@pytest.mark.slow
def test_every_shape_is_the_model_transformers_builds_from_its_config():
    """Each shape's tensors (names and [out, in] shapes) are the parameters of the
    model transformers builds from the written config.json (on the meta device:
    no memory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name, sh in models.SHAPES.items():
        cfg = transformers.AutoConfig.for_model(**sh.config())
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert type(model).__name__ == sh.architecture
        want = dict(sh.tensors())
        if sh.num_experts:     # transformers 5 holds a layer's experts fused; the files hold them one by one
            e, m, h = sh.num_experts, sh.moe_intermediate_size, sh.hidden_size
            want = {k: v for k, v in want.items() if ".mlp.experts." not in k}
            for n in range(sh.num_hidden_layers):
                want[f"model.layers.{n}.mlp.experts.gate_up_proj"] = (e, 2 * m, h)
                want[f"model.layers.{n}.mlp.experts.down_proj"] = (e, h, m)
        assert {k: tuple(v.shape) for k, v in model.named_parameters()} == want, name


def _tiny(**kw) -> "models.Shape":
    return models.Shape("Qwen2ForCausalLM", "qwen2", 64, 96, 2, 4, 2, 300, 1e6, 1e-6, 128,
                        attention_bias=True, **kw)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_the_safetensors_file_holds_the_seeded_values(tmp_path, dtype, monkeypatch):
    """Written in pieces (a piece smaller than a tensor here), read back with
    safetensors, equal to the values rounded by torch (bf16) or numpy (f16)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    monkeypatch.setattr(models, "_CHUNK", 1000)
    sh = _tiny()
    path = models.write_safetensors(tmp_path / "model.safetensors", sh, seed=3, dtype=dtype)
    got = load_file(str(path))
    assert set(got) == {n for n, _ in sh.tensors()}
    for name, s in sh.tensors():
        ref = torch.from_numpy(models.tensor_values(3, name, s).reshape(s))
        want = ref.to(torch.bfloat16) if dtype == "bf16" else torch.from_numpy(ref.numpy().astype(np.float16))
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    norms = [n for n, _ in sh.tensors() if n.endswith("norm.weight")]
    assert all(bool((got[n] == 1).all()) for n in norms)
    w = got["model.layers.1.mlp.down_proj.weight"].float()
    assert abs(float(w.std()) - 0.02) < 0.002                  # normal(0, 0.02)
    other = models.tensor_values(4, "model.layers.1.mlp.down_proj.weight", (64, 96))
    assert not np.array_equal(other, models.tensor_values(3, "model.layers.1.mlp.down_proj.weight", (64, 96)))
    with pytest.raises(ValueError, match="--shape-dtype"):
        models.write_safetensors(tmp_path / "x.safetensors", sh, dtype="f32")


# -- the command lines each side runs ------------------------------------------------------------

def test_command_lines_of_each_side():
    m, b = Path("/m/x.Q4_0.gguf"), Path("/b/llama-bench")
    lb = ["/b/llama-bench", "-m", "/m/x.Q4_0.gguf", "-p", "512", "-n", "0", "-t", "2", "-r", "3", "-o", "json"]
    # llama.cpp reads the file at load (load mode none) unless asked to map it; ik's -rtr reads it at load
    assert peers.llama_bench_command(b, m, 512, 2, 3) == lb + ["-lm", "none"]
    assert peers.llama_bench_command(b, m, 512, 2, 3, mmap=True) == lb
    assert peers.llama_bench_command(b, m, 512, 2, 3, ik=True) == lb + ["-rtr", "1"]
    bb = ["/b/llama-batched-bench", "-m", "/m/x.Q4_0.gguf", "-npp", "128", "-ntg", "128", "-npl", "8",
          "-t", "2", "-tb", "2", "-c", str(8 * 256)]
    assert peers.batched_bench_command(Path(bb[0]), m, 8, 128, 128, 2) == bb + ["-lm", "none"]
    assert peers.batched_bench_command(Path(bb[0]), m, 8, 128, 128, 2, mmap=True) == bb
    assert peers.batched_bench_command(Path(bb[0]), m, 8, 128, 128, 2, ik=True) == bb + ["-rtr"]
    fx = peers.fdx_throughput_command(m, 1, 512, 1, 2, ["--quantization", "auto"])
    assert fx[:3] == [sys.executable, "-m", "fdx.entrypoints.cli"]
    i = fx.index("throughput")
    assert fx[i + 1:] == ["--model", "/m/x.Q4_0.gguf", "--num-requests", "1", "--input-len", "512",
                          "--output-len", "1", "--json", "--quiet", "--num-threads", "2", "--max-model-len", "513",
                          "--quantization", "auto"]
    assert peers.fdx_throughput_command(m, 8, 16, 8, 2, [])[-2:] == ["--max-model-len", "256"]
    assert peers.fdx_throughput_command(m, 65, 8, 8, 2, [])[-2:] == ["--max-num-seqs", "65"]
    src, hf, out = Path("/s"), Path("/h"), Path("/o.gguf")
    assert models.convert_command(src, hf, out, "bf16")[1:] == ["/s/convert_hf_to_gguf.py", "/h", "--outfile",
                                                                  "/o.gguf", "--outtype", "bf16"]
    env = models.convert_env(Path("/stub"))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == "/stub" and env["HF_HUB_OFFLINE"] == "1"
    assert "NO_LOCAL_GGUF" not in env                             # the sources' own gguf-py


def test_the_rotation_runs_each_side_first_in_turn():
    sides = ["llama.cpp", "fdx", "ik"]
    firsts = [peers._alternate(i, sides)[0] for i in range(6)]
    assert firsts == sides + sides
    assert all(sorted(peers._alternate(i, sides)) == sorted(sides) for i in range(6))


def test_ik_source_is_checked_and_never_cloned(tmp_path, monkeypatch):
    monkeypatch.delenv(peers.IK_ENV, raising=False)
    assert peers.ik_source(None) is None
    with pytest.raises(peers.PeerError, match="--ik-llama-src .*not an ik_llama.cpp source tree"):
        peers.ik_source(str(tmp_path))
    (tmp_path / "ggml" / "src").mkdir(parents=True)
    (tmp_path / "CMakeLists.txt").write_text("")
    monkeypatch.setenv(peers.IK_ENV, str(tmp_path))
    assert peers.ik_source(None) == tmp_path
    assert peers.ik_dir(tmp_path, tmp_path).parent == tmp_path / "peers"
    assert peers.ik_dir(tmp_path, tmp_path) != peers.ik_dir(tmp_path / "ggml", tmp_path)


def test_llama_bench_json_is_read_for_its_prompt_test():
    """tests/data/llama_bench_pp64.json is what llama-bench -p 64 -n 0 -r 2 -o json
    printed here; its avg_ts agrees with its own samples."""
    text = (DATA / "llama_bench_pp64.json").read_text()
    rows = json.loads(text)
    row = next(r for r in rows if r["n_prompt"] == 64 and r["n_gen"] == 0)
    got = peers.parse_llama_bench_json("noise before\n" + text, 64)
    assert got == max(row["samples_ts"]) > row["avg_ts"]         # its best repetition, as fdx's best run
    assert row["avg_ts"] == pytest.approx(sum(row["samples_ts"]) / len(row["samples_ts"]), rel=1e-6)
    no_samples = json.dumps([{k: v for k, v in row.items() if k != "samples_ts"}])
    assert peers.parse_llama_bench_json(no_samples, 64) == row["avg_ts"]
    with pytest.raises(peers.PeerError, match="no pp512 result"):
        peers.parse_llama_bench_json(text, 512)
    with pytest.raises(peers.PeerError, match="no pp64 result"):
        peers.parse_llama_bench_json("error: failed to load model", 64)


def test_tables_with_ik_and_prefill_against_a_recompute():
    rng = np.random.default_rng(11)

    def side():
        return {**_figures(rng), "peak_rss_mb": float(rng.uniform(100, 900))}
    rows = [peers.batch_row(b, side(), side(), side()) for b in (1, 32)]
    pre = peers.prefill_row(512, side(), side(), side())
    assert pre["ratio"] == pytest.approx(pre["fdx"]["prompt_tps"] / pre["llama"]["prompt_tps"])
    assert pre["ratio_ik"] == pytest.approx(pre["fdx"]["prompt_tps"] / pre["ik"]["prompt_tps"])
    machine = {"cpu": "c", "cores": 2, "threads": 2, "sgemm_gflops": 1.0, "memory_read_gbps": 1.0,
               "simd": ["avx2", "fma"]}
    table = peers.format_table({"input_len": 8, "output_len": 8, "machine": machine, "ik_llama_cpp": "/ik",
                                "types": [{"type": "Q4_0", "model": "m", "prefill": pre, "batches": rows}],
                                "source": "random weights"})
    assert "machine: c [avx2 fma], 2 cores" in table and "files: random weights" in table
    lines = table.splitlines()
    ik_line = next(x for x in lines if x.startswith("| ik_llama.cpp -rtr |"))
    cells = [c.strip() for c in ik_line.strip("|").split("|")]
    assert float(cells[1]) == pytest.approx(pre["ik"]["prompt_tps"], abs=0.05)
    assert float(cells[2].rstrip("x")) == pytest.approx(pre["ratio_ik"], abs=0.005)
    assert float(cells[3]) == pytest.approx(pre["ik"]["peak_rss_mb"], abs=0.5)
    for row in rows:
        line = next(x for x in lines if x.startswith(f"| {row['batch']} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        for j, k in ((1, "prompt_tps"), (6, "decode_tps"), (11, "all_tps")):
            assert float(cells[j]) == pytest.approx(row["llama"][k], abs=0.05)
            assert float(cells[j + 1]) == pytest.approx(row["ik"][k], abs=0.05)
            assert float(cells[j + 2]) == pytest.approx(row["fdx"][k], abs=0.05)
            assert float(cells[j + 3].rstrip("x")) == pytest.approx(row["fdx"][k] / row["llama"][k], abs=0.005)
            assert float(cells[j + 4].rstrip("x")) == pytest.approx(row["fdx"][k] / row["ik"][k], abs=0.005)
        assert cells[16] == " / ".join(f"{row[s]['peak_rss_mb']:.0f}" for s in ("llama", "ik", "fdx"))


@pytest.mark.slow
def test_peak_resident_memory_of_a_run_is_the_childs(tmp_path):
    """The child's own peak, not this process's memory (which a forked child
    counts until its exec): 300 MB held here, a child that holds nothing."""
    held = np.ones(300 * 2 ** 20 // 8)
    rc, out, err, rss, cpu = peers.run_measured([sys.executable, "-c", "print(1)"], tmp_path / "y.log")
    assert rc == 0 and out.strip() == "1" and rss < 100 and held[-1] == 1.0
    code = "import numpy as np; a = np.ones(300 * 2**20 // 8); print(a.sum())"
    rc, out, err, rss, _ = peers.run_measured([sys.executable, "-c", code], tmp_path / "x.log")
    assert rc == 0 and float(out) == 300 * 2 ** 20 // 8
    assert 300 < rss < 2000
    # its CPU seconds: a child spinning for 0.5 s of its own CPU time, and one sleeping 0.5 s
    spin = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    _, _, _, _, busy = peers.run_measured([sys.executable, "-c", spin], tmp_path / "s.log")
    _, _, _, _, idle = peers.run_measured([sys.executable, "-c", "import time; time.sleep(0.5)"], tmp_path / "t.log")
    assert busy >= 0.5 and idle < busy - 0.4 and cpu < 0.5
    rc, *_ = peers.run_measured([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "z.log")
    (tmp_path / "w").mkdir()                   # run where asked (ik_llama.cpp's tools write llama.log there)
    _, out, *_ = peers.run_measured([sys.executable, "-c", "import os; print(os.getcwd())"], tmp_path / "c.log",
                                    cwd=tmp_path / "w")
    assert out.strip() == str(tmp_path / "w")
    assert rc == 3
    assert (tmp_path / "x.log").read_text().startswith(f"$ {sys.executable} -c ")


@pytest.mark.slow
def test_the_tool_missing_is_one_line_saying_where_to_get_it(tmp_path):
    env = dict(os.environ, FDX_PEERS_TOOL=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "bench", "peers", "--help"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("fdx bench peers: error: fdx bench peers is a developer tool kept in the "
                                 "source tree (scripts/bench_peers/)")
    assert len(out.stderr.strip().splitlines()) == 1


def _built_peers() -> Path | None:
    """The cached llama.cpp build of this machine, if one was made (FDX_PEERS_CACHE, else the default)."""
    d = peers.peer_dir()
    return d if (d / "build.ok").is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_built_peers() is None, reason="llama.cpp is not built in the peers cache "
                                                  "(fdx bench peers builds it; set FDX_PEERS_CACHE)")
def test_end_to_end_on_the_135m_shape_in_q4_0(tmp_path):
    """The whole command on the smallest shape, Q4_0, tiny lengths: the
    checkpoint is written, converted by convert_hf_to_gguf.py (its tokenizer
    recognized as SmolLM2's), quantized, and both sides report figures."""
    cache = os.environ.get("FDX_PEERS_CACHE") or str(peers.peers_root())
    out = subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "bench", "peers", "--shape", "smollm2-135m",
                          "--quant", "Q4_0", "--batch-sizes", "1", "--input-len", "16", "--output-len", "4",
                          "--prefill-len", "32", "--skip-serve", "--json", "--quiet", "--cache-dir", cache],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    (t,) = report["types"]
    assert t["type"] == "Q4_0" and peers.gguf_file_type(Path(t["model"])) == peers._FILE_TYPES["Q4_0"]
    from fdx.model_io.gguf_file import read_gguf
    fields = read_gguf(Path(t["model"])).fields
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert fields["llama.block_count"].contents() == 30
    for side in ("llama", "fdx"):
        assert t["prefill"][side]["prompt_tps"] > 0 and t["prefill"][side]["peak_rss_mb"] > 0
        assert t["batches"][0][side]["decode_tps"] > 0
    assert "random weights of the smollm2-135m shape" in report["source"]


def test_the_cli_hands_fdx_bench_peers_its_own_arguments():
    from fdx.entrypoints.cli import _peers_argv
    assert _peers_argv(["bench", "peers", "--quant", "Q4_0"]) == ["--quant", "Q4_0"]
    assert _peers_argv(["-q", "bench", "peers", "-m", "x.gguf"]) == ["-q", "-m", "x.gguf"]
    assert _peers_argv(["--log-level", "debug", "bench", "peers"]) == ["--log-level", "debug"]
    assert _peers_argv(["generate", "bench", "peers"]) is None          # a prompt that says "bench peers"
    assert _peers_argv(["bench", "throughput"]) is None
    args = peers.build_parser().parse_args(["-q", "--log-level", "debug", "--shape", "qwen2.5-0.5b"])
    assert args.quiet and args.log_level == "debug" and args.shape == "qwen2.5-0.5b"
