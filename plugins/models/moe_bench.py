"""A micro-benchmark of one MoE layer's routed experts: the grouped call
(fdx.ops.moe.experts, one compiled call a layer) against the per-expert
loop (``SparseMoe._expert_loop``: one format product per chosen expert,
main's path before the grouped kernel), on random experts of a real A3B
model's shapes (Qwen3-30B-A3B: hidden 2048, 128 experts of 768, top-8),
in one process, alternating the two, best of several rounds of CPU time
per call::

    python -m fdx.plugins.models.moe_bench --kind q8_0 --rows 1,32 --layers 4

``--layers`` distinct layers are cycled (a decode step streams each layer's
experts from memory, not from cache). The routing is uniform random, so
the expert load is balanced; it is printed per call.

``--engine DIR``: through the engine instead, on a random Qwen3-MoE folder
written to DIR if absent (hidden 512, 4 layers of 64 experts of 256, top-8,
quantized on load by ``--kind``): greedy generation of 32 tokens after 16
prompt tokens at batch 1 and 32, the grouped call against the loop
(FDX_MOE_GROUPED=0) in one process, a fresh engine per side, alternating,
tokens per CPU second (the engine runs in-process), best of ``--rounds``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def _layer(kind: str, experts: int, hidden: int, inter: int, top_k: int, rng):
    from fdx.ops import moe
    from fdx.ops.probes import random_quantized
    from fdx.plugins.models.moe_layers import SparseMoe, stack_experts
    from fdx.plugins.models.weight_formats import BlockWeight, DenseWeight
    import paddle

    def weight(rows: int, cols: int):
        if kind == "f32":
            return DenseWeight(paddle.to_tensor((0.05 * rng.standard_normal((cols, rows))).astype(np.float32)))
        return BlockWeight(random_quantized(kind, rows, cols, rng))

    block = SparseMoe.__new__(SparseMoe)
    block.num_experts, block.top_k, block.intermediate_size = experts, top_k, inter
    block.w_gate_up = [weight(2 * inter, hidden) for _ in range(experts)]
    block.w_down = [weight(hidden, inter) for _ in range(experts)]
    stacks = (stack_experts(block.w_gate_up), stack_experts(block.w_down))
    assert all(isinstance(s, moe.ExpertStack) for s in stacks)
    return block, stacks


def _write_folder(folder, rng) -> None:
    import json

    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab, h, heads, kv, hd, mi, layers, experts, top_k = 1000, 512, 8, 4, 64, 256, 4, 64, 8
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=vocab, hidden_size=h,
               intermediate_size=1024, moe_intermediate_size=mi, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv, head_dim=hd, max_position_embeddings=1024, num_experts=experts,
               num_experts_per_tok=top_k, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
               tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="float32")
    r = lambda *shape: (0.05 * rng.standard_normal(shape)).astype(np.float32)      # noqa: E731
    one = lambda n: np.ones(n, np.float32)                                          # noqa: E731
    w = {"model.embed_tokens.weight": r(vocab, h), "model.norm.weight": one(h), "lm_head.weight": r(vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}"
        w.update({f"{p}.input_layernorm.weight": one(h), f"{p}.post_attention_layernorm.weight": one(h),
                  f"{p}.self_attn.q_proj.weight": r(heads * hd, h), f"{p}.self_attn.k_proj.weight": r(kv * hd, h),
                  f"{p}.self_attn.v_proj.weight": r(kv * hd, h), f"{p}.self_attn.o_proj.weight": r(h, heads * hd),
                  f"{p}.self_attn.q_norm.weight": one(hd), f"{p}.self_attn.k_norm.weight": one(hd),
                  f"{p}.mlp.gate.weight": r(experts, h)})
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            w.update({f"{q}.gate_proj.weight": r(mi, h), f"{q}.up_proj.weight": r(mi, h),
                      f"{q}.down_proj.weight": r(h, mi)})
    folder.mkdir(parents=True)
    save_file(w, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def engine(folder, kind: str, rounds: int, threads: int) -> None:
    import gc
    import os
    from pathlib import Path

    from fdx import LLM, SamplingParams
    from fdx.core.host import cpu_model
    folder = Path(folder)
    rng = np.random.default_rng(1)
    if not folder.exists():
        _write_folder(folder, np.random.default_rng(0))
    print(f"cpu: {cpu_model()}, threads {threads}, quantization {kind}, engine in-process")
    best: dict = {}
    for _ in range(rounds):
        for side in ("grouped", "loop"):
            os.environ["FDX_MOE_GROUPED"] = "1" if side == "grouped" else "0"
            llm = LLM(str(folder), quantization=kind, max_model_len=256, max_num_seqs=32, num_threads=threads,
                      progress=False)
            for bs in (1, 32):
                prompts = [{"prompt_token_ids": rng.integers(3, 1000, 16).tolist()} for _ in range(bs)]
                llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
                t0 = time.process_time()
                llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
                rate = bs * 32 / (time.process_time() - t0)
                best[side, bs] = max(best.get((side, bs), 0.0), rate)
            llm.close()
            del llm
            gc.collect()
    for bs in (1, 32):
        g, lp = best["grouped", bs], best["loop", bs]
        print(f"batch {bs}: grouped {g:.1f}, loop {lp:.1f} tokens per CPU second (best of {rounds}): "
              f"grouped/loop {g / lp:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="q8_0")
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", metavar="DIR", help="through the engine, on a random Qwen3-MoE folder in DIR")
    args = ap.parse_args(argv)
    if args.engine:
        engine(args.engine, args.kind, args.rounds, args.threads)
        return 0
    import paddle
    from fdx.core import kernels
    from fdx.core.host import cpu_model
    from fdx.ops import cpp, moe
    from fdx.plugins.backends.cpu import probe_kernels
    paddle.set_device("cpu")
    paddle.base.core.set_num_threads(args.threads)
    table = probe_kernels(args.threads)
    print(f"cpu: {cpu_model()}, threads {args.threads}, grouped build {moe.build(table)}, kind {args.kind}, "
          f"{args.layers} layers of {args.experts} experts [{2 * args.inter}x{args.hidden}, "
          f"{args.hidden}x{args.inter}] top-{args.top_k}")
    rng = np.random.default_rng(0)
    layers = [_layer(args.kind, args.experts, args.hidden, args.inter, args.top_k, rng) for _ in range(args.layers)]
    with kernels.using(table):
        for rows in [int(r) for r in args.rows.split(",")]:
            x = paddle.to_tensor(rng.standard_normal((rows, args.hidden)).astype(np.float32))
            ids = np.stack([rng.permutation(args.experts)[:args.top_k] for _ in range(rows)]).astype(np.int64)
            w = rng.random((rows, args.top_k)).astype(np.float32)
            counts = np.bincount(ids.reshape(-1), minlength=args.experts)
            sides = {"grouped": lambda b, s: moe.experts(x, ids, w, *s),
                     "loop": lambda b, s: b._expert_loop(x, ids, w, counts)}
            best = {name: float("inf") for name in sides}
            for _ in range(args.rounds):
                for name, fn in sides.items():            # alternating sides each round
                    t0 = time.process_time()
                    for block, stacks in layers:
                        fn(block, stacks)
                    best[name] = min(best[name], (time.process_time() - t0) / len(layers))
            a, b = (np.asarray(sides[n](*layers[0]).numpy()) for n in ("grouped", "loop"))
            diff = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
            print(f"rows {rows}: experts used {int((counts > 0).sum())}, load max/mean "
                  f"{counts.max() / max(counts[counts > 0].mean(), 1):.2f}; grouped {best['grouped'] * 1e3:.2f} ms, "
                  f"loop {best['loop'] * 1e3:.2f} ms CPU a layer: loop/grouped {best['loop'] / best['grouped']:.2f}x "
                  f"(max relative difference {diff:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
