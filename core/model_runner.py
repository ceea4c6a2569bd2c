"""Turns a SchedulerOutput into one batched forward pass and sampled tokens."""
from __future__ import annotations

import numpy as np
import paddle

from fdx.core.interfaces import ModelRunnerOutput, SchedulerOutput
from fdx.ops.attention import build_attention_metadata
from fdx.plugins.decoding.sampler import Sampler, SamplingBatch


class ModelRunner:
    def __init__(self, model, kv_caches, num_blocks: int, block_size: int, sampler: Sampler,
                 eos_token_ids: set[int]):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        input_ids: list[int] = []
        query_lens, context_lens, block_tables = [], [], []
        logits_rows, samplers = [], []
        for sr in sched.scheduled:
            req, start, n = sr.request, sr.context_len, sr.num_new_tokens
            p = req.num_prompt_tokens
            if start + n <= p:
                input_ids += req.prompt_token_ids[start:start + n]
            else:
                input_ids += (req.prompt_token_ids[start:] + req.output_token_ids[max(0, start - p):start + n - p])
            query_lens.append(n)
            context_lens.append(start)
            block_tables.append(sr.block_table)
            if sr.samples:
                logits_rows.append(len(input_ids) - 1)
                samplers.append(req)

        meta = build_attention_metadata(query_lens, context_lens, block_tables, self.block_size,
                                        self.model.num_kv_heads, self.num_slots)
        ids = paddle.to_tensor(np.asarray(input_ids, dtype=np.int64))
        rows = paddle.to_tensor(np.asarray(logits_rows, dtype=np.int64))
        with paddle.no_grad():
            logits = self.model.forward(ids, meta.positions, self.kv_caches, meta, rows)
        out = ModelRunnerOutput()
        if not samplers:
            return out
        batch = SamplingBatch(
            params=[r.sampling_params for r in samplers],
            prompt_token_ids=[r.prompt_token_ids for r in samplers],
            output_token_ids=[r.output_token_ids for r in samplers],
            generators=[r.generator for r in samplers],
            eos_token_ids=self.eos_token_ids,
        )
        result = self.sampler.sample(logits.numpy(), batch)
        for i, req in enumerate(samplers):
            out.sampled[req.request_id] = int(result.token_ids[i])
            if result.logprobs[i] is not None:
                out.logprobs[req.request_id] = result.logprobs[i]
        return out
