"""The default model runner (contract: ``ModelRunner``): a persistent batch
of per-request state, fed only plain-data ``SchedulerOutput`` steps.

Each step: drop the state of requests in ``finished_req_ids``; build state
for ``new_requests`` (prompt, outputs so far, params, block table) and
extend the tables of ``cached_requests``; gather the step's tokens; one
forward through the attention backend the device backend chose; run the
logits processors over the rows that sample (telling them which requests
joined and left) and the sampler; append each sampled token to its own
request state, so the next step's input needs nothing from the scheduler
but the block ids. Prompt logprobs, logits and hidden-state taps are
computed here when asked.

Under tensor parallel every rank runs this runner over its model shard
(``ctx.rank`` of ``ctx.world_size``): rank 0 samples and shares the ids
(``ctx.share_sampled``); the others append them (``ModelRunner``'s contract).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from fdx.core import activations, kernels
from fdx.core.lora import StepLoRA
from fdx.core.memory import release_step_heap
from fdx.core.guided import apply_guided
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import (AttentionContext, BatchLayout, BatchUpdate, ModelArgs, ModelRunner,
                                 ModelRunnerOutput, RowState, SamplingBatch, SchedulerOutput)
from fdx.core.sampling_params import SamplingParams
from fdx.plugins.decoding.sampler import logprobs_of


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    row: RowState
    pooled_sum: np.ndarray | None = None       # model.task embed, mean pooling: the prompt rows so far
    model_args: ModelArgs | None = None        # its BatchLayout.model_args entry (activation hooks, LoRA)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class DefaultModelRunner(ModelRunner):
    tensor_parallel = True          # follows rank 0's sampling on the other ranks (ModelRunner's contract)

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        ctx = self.ctx
        self.model = ctx.model
        self.spec = ctx.kv_spec
        self.requests: dict[str, RequestState] = {}
        self.in_processors: set[str] = set()      # requests the logits processors hold
        self.rows: list[str] = []                  # last step's sampling rows
        self.capture_logits = ctx.config.decoding.capture_logits
        self.capture_hidden = ctx.config.decoding.capture_hidden_states
        if self.capture_hidden:
            self.model.capture_hidden_states = True
        mc = ctx.config.model
        self.pooling = mc.task == "embed"         # every request pools its prompt (ModelRunnerOutput.pooled)
        self.pooling_type, self.normalize = mc.pooling_type, mc.normalize
        if self.pooling:                           # the engine checked Model.supports_pooling
            self.model.capture_pooling_hidden_states = True
        self.taps: dict = {}
        self.layout: BatchLayout | None = None     # this step's, built by _forward for the model
        self.step_activations: activations.StepActivations | None = None   # this step's hooks, if any
        self.step_lora: StepLoRA | None = None     # this step's adapter groups, if a request has one
        self.guided = None                         # this step's guided bitmask (SchedulerOutput.guided)
        self.drafts: dict[str, list[int]] = {}     # this step's speculative drafts (SchedulerOutput.spec_token_ids)
        self.draft_probs: dict[str, bytes] = {}    # of those, SchedulerOutput.spec_draft_probs
        if ctx.connector is not None:
            ctx.connector.register_kv_caches(ctx.kv_caches, ctx.kv_spec)

    # -- the persistent batch ---------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> list[str]:
        removed = []
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            if rid in self.in_processors:
                self.in_processors.discard(rid)
                removed.append(rid)
        for nr in so.new_requests:
            outputs = list(nr.output_token_ids)
            prompt = list(nr.prompt_token_ids)
            params = nr.sampling_params
            if self.ctx.rank != 0 and params.prompt_logprobs is not None:   # rank 0 alone reads logits
                params = replace(params, prompt_logprobs=None)
            self.requests[nr.request_id] = RequestState(
                nr.request_id, prompt, outputs, params, list(nr.block_ids), nr.num_computed_tokens,
                RowState(nr.request_id, params, prompt, outputs),
                model_args=ModelArgs.of(activations.parse(nr.sampling_params.activations), nr.lora_name))
        for cr in so.cached_requests:
            st = self.requests[cr.request_id]
            st.block_ids.extend(cr.new_block_ids)
            if st.num_computed_tokens != cr.num_computed_tokens:
                raise RuntimeError(f"runner and scheduler disagree on {cr.request_id}: "
                                   f"{st.num_computed_tokens} != {cr.num_computed_tokens} computed tokens")
        return removed

    # -- one step ---------------------------------------------------------------------
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        with kernels.using(self.ctx.kernels):      # this engine's probed kernels, for this step only
            return self._execute(so)

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        ctx = self.ctx
        removed = self._update_states(so)
        self.guided = so.guided
        out = ModelRunnerOutput()
        if ctx.connector is not None:
            ctx.connector.start_load_kv(so.kv_connector_metadata)
        if so.num_scheduled_tokens:
            self._forward(so, removed, out)
            release_step_heap(sum(so.num_scheduled_tokens.values()))     # a prefill's freed activations
        if ctx.connector is not None:
            sending, recving = ctx.connector.get_finished()
            out.finished_sending, out.finished_recving = sorted(sending), sorted(recving)
        return out

    def _forward(self, so: SchedulerOutput, removed: list[str], out: ModelRunnerOutput) -> None:
        ctx = self.ctx
        input_ids: list[int] = []
        query_lens, context_lens, tables = [], [], []
        sample_rows, samplers = [], []
        prompt_rows: list[tuple[RequestState, int, int, int]] = []   # (state, first row, count, start)
        row_starts, model_args = [], []
        self.drafts, self.draft_probs = {}, {}  # this step's speculative drafts (and their probabilities)
        for rid, n in so.num_scheduled_tokens.items():
            st = self.requests[rid]
            start, p = st.num_computed_tokens, len(st.prompt_token_ids)
            row_starts.append(len(input_ids))
            model_args.append(st.model_args)
            drafts = so.spec_token_ids.get(rid, ())
            n_real = n - len(drafts)           # the request's own tokens; its drafts follow them
            if start + n_real <= p:
                input_ids += st.prompt_token_ids[start:start + n_real]
            else:
                input_ids += (st.prompt_token_ids[start:]
                              + st.output_token_ids[max(0, start - p):start + n_real - p])
            if drafts:
                input_ids += drafts
                self.drafts[rid] = list(drafts)
                if rid in so.spec_draft_probs:
                    self.draft_probs[rid] = so.spec_draft_probs[rid]
                n = n_real                     # below: the rows up to the pending token's
            if st.params.prompt_logprobs is not None and start < p - 1:
                count = min(start + n, p - 1) - start
                prompt_rows.append((st, len(input_ids) - n, count, start))
            query_lens.append(n + len(drafts))
            context_lens.append(start)
            tables.append(st.block_ids)
            st.num_computed_tokens = start + n     # speculated: the drafts kept are added by _sample
            if start + n == st.num_tokens:
                sample_rows.extend(range(len(input_ids) - 1 - len(drafts), len(input_ids)))
                samplers.append(st)

        extra = [r for st, first, count, _ in prompt_rows for r in range(first, first + count)]
        self.layout = BatchLayout(tuple(so.num_scheduled_tokens), tuple(row_starts), tuple(query_lens),
                                  tuple(context_lens), tuple(sample_rows + extra), tuple(model_args))
        self.step_activations = None
        if any(a is not None and a.activations is not None for a in model_args):
            from fdx.core.plugins import get_plugin_manager
            plugins = ctx.plugins if ctx.plugins is not None else get_plugin_manager()
            self.step_activations = activations.StepActivations(
                self.layout, lambda name: plugins.get("activation_function", name)) or None
        self.step_lora = None
        if any(a is not None and a.lora is not None for a in model_args):
            from fdx.ops.dense import lora_matmul        # here: the module imports Paddle (a TP engine process may not)
            self.step_lora = StepLoRA(self.layout, lora_matmul) or None
        logits = self._logits(input_ids, query_lens, context_lens, tables, sample_rows + extra)
        if self.step_activations is not None and self.step_activations.captured:
            out.activations = self.step_activations.captured
        if self.pooling:
            self._pool(so, query_lens, out)
        if (ctx.sampler.device_logits and not prompt_rows and not self.capture_logits
                and not self.drafts):
            if samplers:                # a device sampler: the logits stay where they are (see _sample)
                self._sample(samplers, logits, removed, out)
            else:
                self.taps = {}
            return
        logits = _host_float32(logits)
        raw, prompt_logits = logits[:len(sample_rows)], logits[len(sample_rows):]

        k = 0
        for st, _, count, start in prompt_rows:
            targets = st.prompt_token_ids[start + 1:start + 1 + count]
            out.prompt_logprobs[st.request_id] = logprobs_of(prompt_logits[k:k + count], np.asarray(targets),
                                                             st.params.prompt_logprobs)
            k += count
        if not samplers:
            self.taps = {}
            return
        self._sample(samplers, raw, removed, out)

    def _pool(self, so: SchedulerOutput, query_lens: list[int], out: ModelRunnerOutput) -> None:
        """Pool each request's prompt rows of this step (a prompt may come in
        chunks: mean pooling sums them as they come); a request whose prompt
        is done gets its embedding in ``out.pooled``."""
        hidden = self.model.pooling_hidden_states
        offset = 0
        for (rid, n), q in zip(so.num_scheduled_tokens.items(), query_lens):
            st = self.requests[rid]
            p = len(st.prompt_token_ids)
            start = st.num_computed_tokens - n           # already advanced by _forward
            count = max(0, min(start + n, p) - start)    # this step's prompt rows
            if count and self.pooling_type == "mean":
                rows = hidden[offset:offset + count].astype("float32").numpy().sum(axis=0, dtype=np.float64)
                st.pooled_sum = rows if st.pooled_sum is None else st.pooled_sum + rows
            if count and start + n >= p:                 # the prompt is done
                if self.pooling_type == "mean":
                    vec = st.pooled_sum / p
                else:
                    vec = hidden[offset + count - 1].astype("float32").numpy().astype(np.float64)
                if self.normalize:
                    vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
                out.pooled[rid] = vec.astype(np.float32)
            offset += q

    def _logits(self, input_ids: list[int], query_lens: list[int], context_lens: list[int],
                tables: list[list[int]], rows: list[int]):
        """One forward of the step's tokens: logits [len(rows), vocab] for those token rows."""
        ctx = self.ctx
        meta = ctx.attention.build_metadata(query_lens, context_lens, tables, self.spec,
                                            self.model.num_heads)
        attn = AttentionContext(ctx.attention, meta, ctx.connector, self.layout, self.step_activations,
                                self.step_lora)
        import paddle                      # here, not at import: a tensor parallel engine process never loads it
        with paddle.no_grad():
            return self.model.forward(paddle.to_tensor(np.asarray(input_ids, dtype=np.int64)), attn.positions,
                                      ctx.kv_caches, attn, paddle.to_tensor(np.asarray(rows, dtype=np.int64)))

    def _sample(self, samplers: list[RequestState], raw, removed: list[str],
                out: ModelRunnerOutput) -> None:
        """``raw``: float32 numpy logits of the sampling rows, or (a device
        sampler) the model's logits tensor, moved to the host only when a
        logits processor has work this step."""
        ctx = self.ctx
        if self.drafts:                 # speculative decoding: several rows per request (_verify)
            return self._verify(samplers, raw, removed, out)
        if ctx.rank != 0:               # a tensor parallel rank that follows: rank 0's ids, no logits read
            ids = ctx.share_sampled(np.zeros(len(samplers), dtype=np.int64))
            for st, token in zip(samplers, ids.tolist()):
                st.output_token_ids.append(int(token))
            self.taps = {}
            return
        rows = self._update_processors(samplers, removed)
        on_host = isinstance(raw, np.ndarray)
        busy = self.guided is not None or any(p.active for p in ctx.logits_processors)
        if not on_host and busy:
            raw, on_host = _host_float32(raw), True
        # The processors may edit in place; keep the raw logits apart only when
        # something reads them (logprobs are of the raw logits; the logits tap).
        keep_raw = self.capture_logits or any(st.params.logprobs is not None for st in samplers)
        x = raw
        if on_host:
            if keep_raw:
                x = raw.copy()
            x = self._processed(x, rows)
        batch = SamplingBatch(
            params=[st.params for st in samplers], prompt_token_ids=[st.prompt_token_ids for st in samplers],
            output_token_ids=[st.output_token_ids for st in samplers], eos_token_ids=ctx.eos_token_ids,
            request_ids=rows)
        result = ctx.sampler.sample(x, batch, raw_logits=raw if keep_raw else None)
        if ctx.share_sampled is not None:           # rank 0 of several: the others take the same ids
            ctx.share_sampled(np.asarray([int(t) for t in result.token_ids[:len(samplers)]], dtype=np.int64))
        for i, st in enumerate(samplers):
            token = int(result.token_ids[i])
            st.output_token_ids.append(token)
            out.sampled[st.request_id] = token
            if result.logprobs[i] is not None:
                out.logprobs[st.request_id] = result.logprobs[i]
        self.taps = {"sampled_request_ids": rows}
        if self.capture_logits:
            self.taps["logits"] = raw
        if self.capture_hidden and self.model.last_hidden_states is not None:
            self.taps["hidden_states"] = self.model.last_hidden_states.numpy()[:len(rows)]

    def _rejection_sample(self, st: RequestState, x, raw, batch: SamplingBatch, first: int, count: int,
                          tokens: list[int], logprobs: list) -> None:
        """Drafts proposed with probabilities: rows ``first .. first+count``
        of ``tokens`` (and their logprobs) become what rejection sampling
        keeps (``fdx.core.spec.rejection_sample``), so ``accept_sampled``
        over them gives the same prefix on every rank."""
        from fdx.core.spec import rejection_sample
        drafts = self.drafts[st.request_id]
        q = np.frombuffer(self.draft_probs[st.request_id], dtype=np.float32).reshape(len(drafts), -1)
        rows = slice(first, first + count)
        sub = SamplingBatch(params=batch.params[rows], prompt_token_ids=batch.prompt_token_ids[rows],
                            output_token_ids=batch.output_token_ids[rows], eos_token_ids=batch.eos_token_ids)
        target = self.ctx.sampler.probs(x[rows], sub)
        seed = st.params.seed
        rng = (np.random.default_rng([seed, len(st.output_token_ids), 1]) if seed is not None
               else self.ctx.sampler.rng or np.random.default_rng())
        kept = rejection_sample(target, drafts, q, rng.random((count, 2)))
        tokens[first:first + len(kept)] = kept
        if st.params.logprobs is not None:
            logprobs[first:first + len(kept)] = logprobs_of(raw[first:first + len(kept)], np.asarray(kept),
                                                            st.params.logprobs)

    def _update_processors(self, samplers: list[RequestState], removed: list[str]) -> list[str]:
        """Tell the logits processors the step's rows (one per sampling
        request: who joined, who left); returns the rows' request ids."""
        rows = [st.request_id for st in samplers]
        added = [st.row for st in samplers if st.request_id not in self.in_processors]
        self.in_processors.update(rows)
        update = BatchUpdate(added, removed, rows, rows != self.rows)
        self.rows = rows
        for processor in self.ctx.logits_processors:
            processor.update_state(update)
        return rows

    def _processed(self, x: np.ndarray, rows: list[str], guided: bool = True) -> np.ndarray:
        """The logits processors, then (``guided``) the grammar's mask, over one row per request."""
        for processor in self.ctx.logits_processors:
            x = processor.apply(x)
        if guided and self.guided is not None:     # the grammar's mask, after every other processor
            x = apply_guided(x, self.guided, {rid: i for i, rid in enumerate(rows)}, self.ctx.eos_token_ids)
        return x

    def _verify(self, samplers: list[RequestState], raw, removed: list[str], out: ModelRunnerOutput) -> None:
        """A step with speculative drafts: ``raw`` holds, per request, its
        pending token's row and then one row per draft. Each row j is
        sampled as the request would sample its token j without
        speculation: the first rows (one per request) go through the logits
        processors as always (a speculated request has none of its own:
        core/spec.py), every row through the grammar's mask (a guided
        request has one bitmask row per verified position) and the sampler with
        the request's seed at that output position. The drafts are kept
        while they equal those samples (``fdx.core.spec.accept_sampled``);
        drafts with probabilities go through rejection sampling. Under
        tensor parallel rank 0 shares every row's token; each rank accepts
        the same prefix."""
        from fdx.core.spec import accept_sampled
        ctx = self.ctx
        counts = [1 + len(self.drafts.get(st.request_id, ())) for st in samplers]
        firsts = np.cumsum([0] + counts[:-1])
        if ctx.rank != 0:
            tokens = ctx.share_sampled(np.zeros(sum(counts), dtype=np.int64)).tolist()
        else:
            raw = raw if isinstance(raw, np.ndarray) else _host_float32(raw)
            rows = self._update_processors(samplers, removed)
            x = raw.copy()
            x[firsts] = self._processed(raw[firsts], rows, guided=False)   # raw[firsts]: a copy to edit
            if self.guided is not None:    # the grammar's mask on every verified row (core/guided.py)
                row_of = {st.request_id: list(range(f, f + c)) for st, c, f in zip(samplers, counts, firsts.tolist())}
                x = apply_guided(x, self.guided, row_of, ctx.eos_token_ids)
            params, prompts, outputs, ids = [], [], [], []
            for st, c in zip(samplers, counts):
                drafts = self.drafts.get(st.request_id, [])
                for j in range(c):
                    params.append(st.params)
                    prompts.append(st.prompt_token_ids)
                    outputs.append(st.output_token_ids + drafts[:j])
                    ids.append(st.request_id)
            batch = SamplingBatch(params=params, prompt_token_ids=prompts, output_token_ids=outputs,
                                  eos_token_ids=ctx.eos_token_ids, request_ids=ids)
            result = ctx.sampler.sample(x, batch, raw_logits=raw)
            tokens = [int(t) for t in result.token_ids]
            logprobs = list(result.logprobs)
            for st, c, first in zip(samplers, counts, firsts.tolist()):
                if st.request_id in self.draft_probs:
                    self._rejection_sample(st, x, raw, batch, first, c, tokens, logprobs)
            if ctx.share_sampled is not None:
                ctx.share_sampled(np.asarray(tokens, dtype=np.int64))
        for st, c, first in zip(samplers, counts, firsts.tolist()):
            rid = st.request_id
            drafts = self.drafts.get(rid, [])
            accepted = accept_sampled(drafts, tokens[first:first + c])
            st.output_token_ids.extend(accepted)
            st.num_computed_tokens += len(accepted) - 1     # the drafts kept: their KV is valid
            if ctx.rank != 0:
                continue
            out.sampled[rid] = accepted[0]
            lps = logprobs[first:first + len(accepted)]
            if lps[0] is not None:
                out.logprobs[rid] = lps[0]
            if drafts:
                out.accepted[rid] = accepted
                if lps[0] is not None:
                    out.accepted_logprobs[rid] = list(lps)
        if ctx.rank != 0:
            self.taps = {}
            return
        rows = [st.request_id for st in samplers]
        self.taps = {"sampled_request_ids": rows}
        if self.capture_logits:
            self.taps["logits"] = raw[firsts]
        if self.capture_hidden and self.model.last_hidden_states is not None:
            self.taps["hidden_states"] = self.model.last_hidden_states.numpy()[firsts]

    def last_step_taps(self) -> dict:
        return self.taps


def _host_float32(logits) -> np.ndarray:
    """The logits as a float32 numpy array (cast first when the model's dtype is not float32)."""
    import paddle
    return (logits if logits.dtype == paddle.float32 else logits.astype("float32")).numpy()


@hookimpl
def fdx_register_model_runners(register):
    register("default", DefaultModelRunner)    # tp.py and cuda_graph.py register theirs
