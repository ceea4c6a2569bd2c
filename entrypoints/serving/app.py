"""``fdx serve``: the OpenAI-compatible server (FastAPI on uvicorn).

This process tokenizes, renders chat templates, detokenizes and streams;
the EngineCore steps in its own process (entrypoints/serving/engine_proc.py). Endpoints:
GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST
/v1/embeddings, POST /tokenize, POST /detokenize, GET /health, GET /metrics,
GET /version. See docs/serving.md.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fdx.model_io.loader import check_model_path, is_default_model, load_tokenizer
from fdx.core.config import ConfigError, FdxConfig
from fdx.core.generation import CHAT_DEFAULTS, chat_defaults_for, defaults_for
from fdx.core.guided import constraint_of
from fdx.core.plugins import get_serving_plugin_manager
from fdx.core.chat_output import ChatRequestError, chat_parser, choice_outputs, tool_plan
from fdx.entrypoints.serving.engine_client import EngineClient, EngineDeadError
from fdx.entrypoints.serving.engine_proc import user_message
from fdx.core.messages import EngineRejected, SeqDelta
from fdx.entrypoints.serving.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from fdx.core.output import SequenceState, split_n
from fdx.core.request import PromptError, check_prompt
from fdx.entrypoints.serving import ui
from fdx.entrypoints.serving.rendering import Renderer, activations_json
from fdx.entrypoints.serving.signals import GracefulServer
from fdx.entrypoints.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from fdx.entrypoints.serving import edge, pooling, security, tokenizing
from fdx.core.sampling_params import SamplingParams, bad_word_sequences

log = logging.getLogger("fdx.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_SEQS_PER_REQUEST = 1024           # n x prompts in one request


def fdx_version() -> str:
    try:
        from importlib.metadata import version
        return version("fdx")
    except Exception:
        return "unknown"


def model_names(config: FdxConfig) -> list[str]:
    """The served name first, then the aliases a request may use."""
    model = config.model.model
    if model is None:
        natural = [DEFAULT_MODEL_NAME]
    else:
        p = Path(model)
        natural = [p.name[:-5] if p.name.lower().endswith(".gguf") else p.name, model]
    served = config.server.served_model_name
    names = ([served] if served else []) + natural
    return list(dict.fromkeys(names))


# fill-in-the-middle tokens by family: (prefix, suffix, middle), the first a tokenizer has all of is used
FIM_TOKENS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),             # StarCoder, SantaCoder
              ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),       # Qwen2.5-Coder
              ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))             # DeepSeek-Coder


def fim_token_ids(tokenizer) -> tuple[int, int, int] | None:
    for names in FIM_TOKENS:
        ids = tokenizer.convert_tokens_to_ids(list(names))
        if all(i is not None for i in ids):
            return tuple(ids)
    return None


def best_of(seqs: list[SequenceState], n: int, logprobs: bool) -> list[SequenceState]:
    """Each prompt's ``n`` candidates of the highest cumulative logprob (of
    their sampled tokens), best first, numbered again; their logprobs
    dropped unless the request asked for them."""
    kept = []
    for p in sorted({s.prompt_index for s in seqs}):
        mine = [s for s in seqs if s.prompt_index == p]
        mine.sort(key=lambda s: -sum(e[1] for tid, lps in zip(s.token_ids, s.logprobs)
                                     for e in lps if int(e[0]) == tid))
        for j, s in enumerate(mine[:n]):
            s.index = p * n + j
            if not logprobs:
                s.logprobs = None
            kept.append(s)
    return kept


class ServerStopping(Exception):
    """The server is shutting down."""


def rejection(msg: EngineRejected) -> APIError:
    """The engine's refusal of a request, in OpenAI's error shape."""
    text = msg.message
    param = text.split("invalid sampling parameter ", 1)[1].split(":", 1)[0] \
        if text.startswith("invalid sampling parameter ") and ":" in text else None
    if msg.status == 429:
        return APIError(429, text, type="rate_limit_error", param=param, code="guided_compiles_busy")
    if msg.status == 408:
        return APIError(408, text, type="timeout", param=param, code="guided_compile_timeout")
    return APIError(msg.status, text, param=param)


# -- one HTTP generation request: its sequences in the engine -----------------------

class RequestGroup:
    def __init__(self, server: "Server", seqs: list[SequenceState], engine_params: list[SamplingParams],
                 prefix: str = "", trace: dict[str, str] | None = None, log: dict | None = None,
                 lora: str | None = None):
        self.server = server
        self.lora = lora                          # the LoRA adapter the request's model field named
        self.seqs = seqs
        self.engine_params = engine_params
        self.prefix = prefix                      # the engine ids' stem: the request id (unique in flight)
        self.trace = trace                        # X-Request-Id and W3C trace context, for the engine
        self.log = log if log is not None else {}   # the request's log line (edge.GuardMiddleware)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = len(seqs)
        self.queued = {s.request_id for s in seqs}     # no token yet
        self.closed = False
        self._getter: asyncio.Future | None = None

    def start(self) -> None:
        srv = self.server
        srv.groups.add(self)
        srv.prefixes.add(self.prefix)
        srv.num_queued += len(self.seqs)
        srv.metrics.api_in_flight.set(len(srv.groups))
        try:
            extra = {} if self.lora is None else {"lora": self.lora}
            for seq, params in zip(self.seqs, self.engine_params):
                srv.engine.add(seq.request_id, seq.prompt_token_ids, params,
                               lambda msg, seq=seq: self.queue.put_nowait((seq, msg)), trace=self.trace, **extra)
        except Exception:
            self.close()
            raise

    def fail(self, exc: BaseException) -> None:
        self.queue.put_nowait((None, exc))

    async def next(self, timeout: float | None = None) -> SequenceState | None:
        """Apply the next engine message; return the sequence it changed
        (None on timeout). Raises APIError / EngineDeadError / ServerStopping."""
        if self._getter is None:
            self._getter = asyncio.ensure_future(self.queue.get())
        # not asyncio.wait_for: on 3.11 it can drop an item that arrives as the timeout fires
        done, _ = await asyncio.wait({self._getter}, timeout=timeout)
        if not done:
            return None
        seq, msg = self._getter.result()
        self._getter = None
        if isinstance(msg, BaseException):
            raise msg
        if isinstance(msg, EngineRejected):
            raise rejection(msg)
        assert isinstance(msg, SeqDelta)
        if seq.finished:
            return seq
        before, last = len(seq.token_ids), seq.last_token_time
        seq.apply(msg)                            # as LLM's OutputProcessor does (core/output.py)
        self.server.metrics.tokens_arrived(seq, len(seq.token_ids) - before, last)
        if seq.request_id in self.queued and (seq.token_ids or seq.finished):
            self.queued.discard(seq.request_id)
            self.server.num_queued -= 1
        if seq.finished:
            self.unfinished -= 1
            self.server.metrics.sequence_finished(seq)
        return seq

    async def wait_compiled(self, http_request: Request) -> None:
        """A constrained request: wait until the engine has compiled its
        constraint (an empty first delta for each sequence) or refused it
        (APIError), so that a bad one is a 4xx before any response starts."""
        unheard = {s.request_id for s in self.seqs}
        next_check = time.monotonic() + 1.0
        while unheard:
            seq = await self.next(timeout=1.0)
            if seq is not None:
                unheard.discard(seq.request_id)
            if time.monotonic() >= next_check:
                if await http_request.is_disconnected():      # close() aborts: its compile is cancelled
                    raise ServerStopping("the client disconnected")
                next_check = time.monotonic() + 1.0

    async def wait_all(self, http_request: Request) -> None:
        """Run to the end, aborting if the client goes away."""
        next_check = time.monotonic() + 1.0
        while self.unfinished:
            await self.next(timeout=1.0)
            if time.monotonic() >= next_check:
                if await http_request.is_disconnected():
                    raise ServerStopping("the client disconnected")
                next_check = time.monotonic() + 1.0

    def close(self) -> None:
        """Abort what is still running and release the group's slots (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self._getter is not None:
            self._getter.cancel()
        srv = self.server
        live = [s for s in self.seqs if not s.finished]
        if live:
            srv.engine.abort([s.request_id for s in live])
            now = time.monotonic()
            for s in live:
                s.finish_reason, s.finished_time = "abort", now
                srv.metrics.sequence_finished(s)
        srv.num_queued -= len(self.queued)
        self.queued.clear()
        srv.groups.discard(self)
        srv.prefixes.discard(self.prefix)
        srv.metrics.api_in_flight.set(len(srv.groups))
        reasons = sorted({s.finish_reason or "abort" for s in self.seqs})
        self.log["detail"] = (f"{len(self.seqs)} sequence{'s' if len(self.seqs) > 1 else ''}, "
                              f"{sum(len(s.prompt_token_ids) for s in self.seqs)} prompt + "
                              f"{sum(len(s.token_ids) for s in self.seqs)} generated tokens, "
                              f"finish {'/'.join(reasons)}")


# -- the server state and endpoints ----------------------------------------------------

class Server:
    def __init__(self, config: FdxConfig):
        self.config = config
        self.sc = config.server
        self.names = model_names(config)
        self.model_name = self.names[0]
        # LoRA adapters a request's model field may name: name -> path (lora.lora_modules, then
        # /v1/load_lora_adapter; the engine loads them, up to lora.max_loras at a time)
        self.loras: dict[str, str] = dict(config.lora.lora_modules)
        if config.lora.enable_lora and config.scheduler.request_scheduler != "local":
            raise ConfigError("config key 'lora.enable_lora': LoRA adapters run with scheduler.request_scheduler "
                              "local only")
        for name in self.loras:
            if name in self.names:
                raise ConfigError(f"config key 'lora.lora_modules': adapter name {name!r} is the served "
                                  "model's name")
        self.metrics = ServerMetrics(self.model_name)
        # the plugins this process looks up (no Paddle here: docs/serving.md), loaded
        # now, before uvicorn installs its signal handlers
        self.plugins = get_serving_plugin_manager()
        self.tool_parser = self._parser("tool_parser", "tool_call_parser")
        self.reasoning_parser = self._parser("reasoning_parser", "reasoning_parser")
        if self.sc.enable_auto_tool_choice and self.tool_parser is None:
            raise ConfigError("config key 'server.enable_auto_tool_choice' needs server.tool_call_parser "
                              "(--tool-call-parser) to name a tool-call parser")
        if config.parallel.data_parallel_size > 1:       # N engine processes behind this server
            from fdx.entrypoints.serving.data_parallel import DataParallelClient, DataParallelCollector
            self.engine = DataParallelClient(config, on_stats=self.metrics.observe_engine,
                                             on_death=self._on_engine_death)
            self.metrics.registry.register(DataParallelCollector(self.metrics.labels, self.engine))
        else:
            self.engine = EngineClient(config, on_stats=self.metrics.observe_engine, on_death=self._on_engine_death)
        if config.scheduler.request_scheduler != "local":     # requests go through a shared queue
            from fdx.entrypoints.serving.request_scheduler import wrap_engine
            self.engine = wrap_engine(config, self.engine, self.metrics, self.plugins)
        self.tokenizer = None
        self.render: Renderer | None = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.hidden_size = 0                      # an embedding's length (model.task embed)
        self.generation_config: dict[str, Any] = {}   # the model's sampling defaults
        self.chat_defaults: dict[str, Any] = dict(CHAT_DEFAULTS)   # fdx's for chat, for this model
        self.accepting = False
        self.loading = True                       # until the engine is loaded and warmed: /health says so
        self.groups: set[RequestGroup] = set()
        self.prefixes: set[str] = set()           # engine id stems in flight (RequestGroup.prefix)
        self.num_queued = 0                       # sequences sent to the engine with no token yet
        self.exit_code = 0
        self.uvicorn = None                       # set by run_server
        self.created = int(time.time())

    def _parser(self, kind: str, key: str):
        """(class, settings) of the chat output parser ``server.<key>`` names, or None."""
        return chat_parser(self.plugins, self.config, kind, key)

    # -- lifecycle ------------------------------------------------------------
    async def startup(self) -> None:
        check_model_path(self.config.model.model)      # a bad path fails here, worded as fdx generate words it
        engine_task = asyncio.ensure_future(self.engine.start())
        tok_task = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, self.config.model.model))
        try:
            ready, self.tokenizer = await asyncio.gather(engine_task, tok_task)
            if self.config.model.chat_template is not None:      # --chat-template, as the engine has it
                self.tokenizer.set_chat_template(self.config.model.chat_template)
            self.render = Renderer(self.tokenizer, self.model_name, ready.max_model_len)
        except BaseException:
            tok_task.cancel()
            await self.engine.shutdown()
            raise
        self.max_model_len, self.vocab_size = ready.max_model_len, ready.vocab_size
        self.hidden_size = ready.hidden_size
        self.generation_config = dict(ready.generation_config)
        self.chat_defaults = chat_defaults_for(is_default_model(ready.model_path))
        self.metrics.engine_up.set(1)
        self.metrics.kv_total.set(ready.num_blocks)
        self.metrics.kv_free.set(ready.num_blocks)
        self.accepting = True
        self.loading = False
        log.info("engine ready: %s, max_model_len %d, %d KV blocks of %d, %s",
                 ready.model_path, ready.max_model_len, ready.num_blocks, ready.block_size, ready.backend)

    def begin_shutdown(self) -> None:
        """Stop accepting; end the requests in flight and tell the engine to
        stop (SIGTERM, Ctrl-C)."""
        self.accepting = False
        for group in list(self.groups):
            group.fail(ServerStopping("the server is shutting down"))
        self.engine.stop()

    async def shutdown(self) -> None:
        self.begin_shutdown()
        for group in list(self.groups):
            group.close()
        await self.engine.shutdown()

    def _on_engine_death(self, code: int) -> None:
        # requests in flight were failed by the EngineClient; answer 503 for a
        # moment (so health checks see it), then exit non-zero
        self.accepting = False
        self.metrics.engine_up.set(0)
        self.exit_code = 1
        asyncio.get_running_loop().call_later(self.sc.engine_death_grace_s, self._exit)

    def _exit(self) -> None:
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True

    # -- admission ------------------------------------------------------------
    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter the request's model field names, None for the base
        model; 404 (OpenAI's model_not_found) for a name this server does not serve."""
        if name is None or name in self.names:
            return None
        if name in self.loras:
            return name
        served = ", ".join(repr(n) for n in [self.model_name, *self.loras])
        raise APIError(404, f"the model '{name}' does not exist; this server serves {served}",
                       param="model", code="model_not_found")

    def admit(self, num_seqs: int) -> None:
        if self.engine.dead:
            raise APIError(503, "the engine is not running", type="service_unavailable", code="engine_dead")
        if not self.accepting:
            raise APIError(503, "the server is not accepting requests (starting or shutting down)",
                           type="service_unavailable", code="unavailable")
        mc = self.sc.max_concurrency
        if mc is not None and len(self.groups) >= mc:
            raise APIError(429, f"too many requests in flight (max_concurrency={mc}); retry later",
                           type="rate_limit_error", code="max_concurrency")
        mq = self.sc.max_queue
        if mq is not None and self.num_queued > 0 and self.num_queued + num_seqs > mq:
            raise APIError(429, f"the queue is full ({self.num_queued} sequences waiting, max_queue={mq}); "
                           "retry later", type="rate_limit_error", code="queue_full")

    def with_defaults(self, req, kwargs: dict[str, Any], chat: bool) -> dict[str, Any]:
        """The model's generation defaults (and fdx's chat defaults, for chat)
        for every field the request body left out (core/generation.py)."""
        given = req.model_fields_set
        for name, value in defaults_for(self.generation_config, chat, self.chat_defaults).items():
            fields = ("max_tokens", "max_completion_tokens") if name == "max_tokens" else (name,)
            if not given.intersection(fields):
                kwargs[name] = value
        return kwargs

    def sampling_params(self, kwargs: dict[str, Any]) -> SamplingParams:
        try:
            return SamplingParams(**kwargs)
        except (TypeError, ValueError) as e:
            msg = str(e)
            param = msg.split("invalid sampling parameter ", 1)[-1].split("=", 1)[0] if "=" in msg else None
            raise APIError(400, msg, param=param) from None

    async def tokenize_bad_words(self, sp: SamplingParams) -> SamplingParams:
        """Tokenize bad_words here, off the event loop, so the engine thread
        only reads token ids (a long list held every stream; docs/reliability.md)."""
        if not sp.bad_words:
            return sp
        encode = lambda t: self.tokenizer.encode(t, add_special_tokens=False)
        seqs = await asyncio.to_thread(bad_word_sequences, encode, sp.bad_words)
        return dataclasses.replace(sp, bad_words=None, bad_words_token_ids=seqs)

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        """The prompt check, here at the edge (the engine's make_request runs the same one)."""
        try:
            check_prompt(ids, self.vocab_size, self.max_model_len)
        except PromptError as e:
            raise APIError(400, str(e), param=param, code=e.code) from None

    def make_group(self, prompts: list[tuple[str | None, list[int]]], sp: SamplingParams,
                   prefix: str, http_request: Request | None = None, lora: str | None = None) -> RequestGroup:
        """The engine requests of one HTTP request: ids ``<request id>-<choice
        index>``; ``<request id>.<6 hex>-<index>`` for an id already in flight
        here, and always under a shared request scheduler (its queue holds the
        ids of every instance, and clients choose theirs) or a KV connector (a
        finished request's blocks stay held under its engine id until its
        transfer ends, after its HTTP answer: a router retrying a pairing on
        this prefill instance sends the same X-Request-Id again)."""
        arrival = time.monotonic()
        if (prefix in self.prefixes or self.config.scheduler.request_scheduler != "local"
                or self.config.cache.kv_connector is not None):
            prefix = f"{prefix}.{secrets.token_hex(3)}"
        seqs, params = [], []
        children = split_n(sp)                  # the one n / seed rule (core/output.py)
        for p_idx, (_text, ids) in enumerate(prompts):
            for i, child in enumerate(children):
                idx = p_idx * sp.n + i
                seqs.append(SequenceState(f"{prefix}-{idx}", idx, p_idx, ids, child, self.tokenizer, arrival))
                params.append(child)            # as it is: the engine matches its stop strings
        scope = http_request.scope if http_request is not None else {}
        return RequestGroup(self, seqs, params, prefix, scope.get("fdx.trace"), scope.get("fdx.log"), lora)

    def content_as_text(self, req) -> bool:
        """Whether special-token text in the messages' content is tokenized as
        plain text: the request's content_special_tokens, or the server's
        (a server set to "text" refuses a request asking for "parse")."""
        asked = getattr(req, "content_special_tokens", None)
        if self.sc.content_special_tokens == "text":
            if asked == "parse":
                raise APIError(400, "this server encodes special-token text in message content as plain text "
                               "(server.content_special_tokens 'text'); a request cannot ask to parse it",
                               param="content_special_tokens")
            return True
        return asked == "text"

    @staticmethod
    async def off_loop_if_large(http_request: Request, fn, *args):
        """``fn(*args)`` (templating, tokenizing) in a worker thread when the
        body was large (edge.read_request), so the event loop keeps streaming."""
        if http_request.scope.get("fdx.body_bytes", 0) > edge.PARSE_ON_LOOP_BYTES:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    # -- the generation endpoints -------------------------------------------------
    def check_generates(self) -> None:
        if self.config.model.task != "generate":
            raise APIError(400, f"this server embeds (model.task={self.config.model.task}): it answers "
                           "/v1/embeddings, not generation requests", param="model", code="wrong_task")

    async def completions(self, req: CompletionRequest, http_request: Request):
        lora = self.check_model(req.model)
        self.check_generates()
        self.admit(0)                 # a 503 while loading, before the prompt is rendered (as /v1/embeddings)
        bad = req.unsupported()
        if bad:
            raise APIError(400, bad[1], param=bad[0])
        edge.check_limits(req, self.sc, self.vocab_size)
        prompts = await self.off_loop_if_large(http_request, self.render.completion_prompts, req.prompt)
        if req.suffix:
            prompts = [(None, self.fim_prompt(ids, req.suffix)) for _, ids in prompts]
        # echo with max_tokens 0 scores the prompt (lm-eval's loglikelihood): one token is computed, never shown
        max_tokens = 1 if req.scores_only() else req.max_tokens if req.max_tokens is not None else 16
        for _, ids in prompts:
            self.check_prompt(ids)
        if req.use_beam_search:
            return await self.beam_search(req, http_request, prompts, max_tokens, lora)
        kwargs = self.with_defaults(req, req.sampling_kwargs(max_tokens), chat=False)
        kwargs["logprobs"] = req.logprobs
        if req.echo and req.logprobs is not None:      # the echoed prompt's tokens with their logprobs
            kwargs["prompt_logprobs"] = max(req.logprobs, kwargs.get("prompt_logprobs") or 0)
        keep = None
        if req.best_of is not None and req.best_of > req.n:   # best_of candidates, the n best returned
            kwargs["n"] = req.best_of
            kwargs["logprobs"] = req.logprobs or 0     # each sampled token's logprob, for the ranking
            keep = functools.partial(best_of, n=req.n, logprobs=req.logprobs is not None)
        sp = self.sampling_params(kwargs)
        sp = await self.tokenize_bad_words(sp)
        return await self._serve(req, http_request, prompts, sp, "cmpl", chat=False, keep=keep, lora=lora)

    def fim_prompt(self, ids: list[int], suffix: str) -> list[int]:
        """``suffix`` as fill in the middle: the prompt between the tokenizer's
        FIM prefix and suffix tokens, the model writes the middle (PSM order,
        as StarCoder, SantaCoder, Qwen2.5-Coder and DeepSeek-Coder were trained)."""
        fim = fim_token_ids(self.tokenizer)
        if fim is None:
            raise APIError(400, "suffix (fill in the middle) needs a tokenizer with FIM tokens ("
                           + "; ".join(" ".join(names) for names in FIM_TOKENS) + "); this model's has none",
                           param="suffix")
        pre, suf, mid = fim
        return [pre, *ids, suf, *self.render._encode(suffix, "suffix", add_special_tokens=False), mid]

    async def beam_search(self, req: CompletionRequest, http_request: Request, prompts, max_tokens: int,
                          lora: str | None = None):
        """vLLM's ``use_beam_search``: core/beam_search.py's search, each step's
        live beams run as one-token engine requests; n beams per prompt, best first."""
        from fdx.core.beam_search import BeamSearchParams, search, step_params
        try:
            params = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                      temperature=req.temperature or 0.0, length_penalty=req.length_penalty)
        except ValueError as e:
            raise APIError(400, str(e).replace("beam_width", "n"),
                           param="n" if "beam_width" in str(e) else "max_tokens") from None
        longest = max(len(ids) for _, ids in prompts)
        if longest + max_tokens > self.max_model_len:
            raise APIError(400, f"the prompt ({longest} tokens) and max_tokens ({max_tokens}) exceed max_model_len "
                           f"({self.max_model_len})", param="max_tokens")
        if req.n * len(prompts) > MAX_SEQS_PER_REQUEST:
            raise APIError(400, f"n x prompts = {req.n * len(prompts)} beams in one request; the limit is "
                           f"{MAX_SEQS_PER_REQUEST}", param="n")
        request_id = http_request.scope.get("fdx.request_id") or secrets.token_hex(16)
        run, step = search([ids for _, ids in prompts], params, self.tokenizer.eos_token_ids), step_params(params)
        try:
            batch, k = next(run), 0
            while True:
                group = self.make_group([(None, b) for b in batch], step, f"{request_id}.beam{k}", http_request, lora)
                self.admit(len(group.seqs))
                group.start()
                await self.run_to_end(group, http_request)
                for s in group.seqs:
                    if s.finish_reason == "abort" or not s.logprobs:
                        raise APIError(500, f"a beam's step ended with {s.finish_reason}", type="internal_error")
                batch, k = run.send([{int(e[0]): e[1] for e in s.logprobs[0]} for s in group.seqs]), k + 1
        except StopIteration as end:
            answers = end.value
        choices, completion = [], 0
        for p, best in enumerate(answers):
            start = len(prompts[p][1])
            for j, beam in enumerate(best):
                completion += len(beam.tokens) - start
                choices.append({"index": p * req.n + j, "logprobs": None, "finish_reason": beam.finish_reason,
                                "stop_reason": None, "cumulative_logprob": beam.cum_logprob,
                                "text": self.tokenizer.decode(beam.tokens[start:], skip_special_tokens=True)})
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return JSONResponse({"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices,
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                       "total_tokens": prompt_tokens + completion}})

    async def chat_completions(self, req: ChatCompletionRequest, http_request: Request):
        lora = self.check_model(req.model)
        self.check_generates()
        self.admit(0)
        bad = req.unsupported()
        if bad:
            raise APIError(400, bad[1], param=bad[0])
        edge.check_limits(req, self.sc, self.vocab_size)
        try:
            plan = tool_plan(req, self.sc)
        except ChatRequestError as e:
            raise APIError(400, e.message, param=e.param) from None
        text, ids = await self.off_loop_if_large(http_request, self.render.chat_prompt, req,
                                                 self.content_as_text(req))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        kwargs = self.with_defaults(req, req.sampling_kwargs(max_tokens), chat=True)
        if req.logprobs:
            kwargs["logprobs"] = req.top_logprobs or 0
        outputs = self.chat_outputs(req, plan, text, kwargs)
        sp = self.sampling_params(kwargs)
        self.check_prompt(ids, param="messages")
        sp = await self.tokenize_bad_words(sp)
        return await self._serve(req, http_request, [(text, ids)], sp, "chatcmpl", chat=True, outputs=outputs,
                                 lora=lora)

    def chat_outputs(self, req, plan, prompt: str, kwargs: dict[str, Any]):
        """core/chat_output.py's choice_outputs over this server's parsers (a 400 naming the field)."""
        try:
            return choice_outputs(plan, prompt, kwargs, self.tokenizer, self.tool_parser, self.reasoning_parser,
                                  req.reasoning_max_tokens)
        except ChatRequestError as e:
            raise APIError(400, e.message, param=e.param) from None

    async def _serve(self, req, http_request: Request, prompts, sp: SamplingParams, kind: str, chat: bool,
                     outputs=None, keep=None, lora: str | None = None):
        # the request id (X-Request-Id, or the one edge.GuardMiddleware made): the response's id is
        # <kind>-<id>, as vLLM's; the engine's ids <id>-<choice index>; the log line names it
        request_id = http_request.scope.get("fdx.request_id") or secrets.token_hex(16)
        rid = f"{kind}-{request_id}"
        if sp.n * len(prompts) > MAX_SEQS_PER_REQUEST:
            raise APIError(400, f"n x prompts = {sp.n * len(prompts)} completions in one request; "
                           f"the limit is {MAX_SEQS_PER_REQUEST}", param="n")
        if sp.max_tokens is not None and not req.model_fields_set & {"max_tokens", "max_completion_tokens"}:
            # a default max_tokens (the model's, fdx's chat default, or 16) never asks past the context
            room = self.max_model_len - max(len(ids) for _, ids in prompts)
            if sp.max_tokens > room:
                sp = dataclasses.replace(sp, max_tokens=room)
        sp = security.check_token_budget(sp, [len(ids) for _, ids in prompts], self.max_model_len,
                                         self.sc.max_tokens_per_request)
        group = self.make_group(prompts, sp, request_id, http_request, lora)
        if outputs is not None:
            for s in group.seqs:
                s.chat_output = outputs()
        self.admit(len(group.seqs))
        group.start()
        if constraint_of(sp) is not None:      # the engine compiles it (once); a bad one is a 4xx here
            try:
                await group.wait_compiled(http_request)
            except APIError as e:
                group.close()
                if req.response_format_kwargs():
                    e.param = "response_format"
                elif chat and getattr(req, "tools", None) and e.param == "guided_json" and not req.guided_json:
                    # the schema fdx built from tools for a required / named call
                    e.param = "tool_choice" if "guided decoding is off" in e.message else "tools"
                    e.message = f"tool_choice {req.tool_choice!r} is guaranteed by guided decoding: {e.message}"
                raise
            except (EngineDeadError, ServerStopping) as e:
                group.close()
                raise APIError(503, str(e), type="service_unavailable") from None
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = include_usage and req.stream_options.continuous_usage_stats
            return security.TimedStreamingResponse(
                self._stream(group, req, prompts, rid, created, chat, include_usage, continuous),
                send_timeout=self.sc.stream_send_timeout_s,
                media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await self.run_to_end(group, http_request)
        seqs = group.seqs if keep is None else keep(group.seqs)       # best_of: the n best
        return JSONResponse(self.render.final_response(seqs, req, prompts, rid, created, chat))

    @staticmethod
    async def run_to_end(group: RequestGroup, http_request: Request) -> None:
        """Wait for a started group's sequences to finish (a 503 when the
        engine or the server stops first); the group is closed after."""
        try:
            await group.wait_all(http_request)
        except (EngineDeadError, ServerStopping) as e:
            raise APIError(503, str(e), type="service_unavailable") from None
        finally:
            group.close()

    async def _stream(self, group: RequestGroup, req, prompts, rid: str, created: int, chat: bool,
                      include_usage: bool, continuous: bool = False) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict], usage: dict | None = None, with_usage: bool = include_usage) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if with_usage:                    # continuous_usage_stats: the counts so far on every chunk
                body["usage"] = usage if usage is not None or not continuous else self.render.usage(group.seqs, prompts, req)
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        text_offsets = {s.index: 0 for s in group.seqs}
        try:
            echo_later = set()                    # echoed prompts whose logprobs come with the first delta
            for s in group.seqs:                  # opening chunk: the role, or the echoed prompt
                if chat:
                    yield chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                elif req.echo and s.logprobs is not None:
                    echo_later.add(s.index)
                elif req.echo:
                    yield chunk([{"index": s.index, "text": self.render.prompt_text(prompts, s.prompt_index),
                                  "logprobs": None, "finish_reason": None}])
            scores_only = not chat and req.scores_only()
            while group.unfinished:
                s = await group.next()
                if s.index in echo_later and (s.prompt_logprobs is not None or s.finished):
                    echo_later.discard(s.index)
                    text = self.render.prompt_text(prompts, s.prompt_index)
                    yield chunk([{"index": s.index, "text": text, "finish_reason": None,
                                  "logprobs": self.render.prompt_completion_logprobs(s, s.params.logprobs)}])
                    text_offsets[s.index] = len(text)
                if scores_only:                   # the computed token is not shown
                    if s.finished:
                        yield chunk([{"index": s.index, "text": "", "logprobs": None, "finish_reason": "length",
                                      "stop_reason": None}])
                    continue
                text = s.take_text()
                if not text and not s.finished:
                    continue                      # held back (a stop string may be starting)
                parsed = s.chat_output
                if chat and parsed is not None:   # reasoning / tool calls: the parsers say what is sent
                    delta = parsed.delta(text, s.finished)
                    if not delta and not s.finished:
                        continue                  # held back by a parser (its logprobs go with the next)
                    reason = parsed.finish_reason(s.finish_reason)
                else:
                    delta = {"content": text} if text or not s.finished else {}
                    reason = s.finish_reason
                lps = s.take_logprobs()
                if chat:
                    choice = {"index": s.index, "delta": delta,
                              "logprobs": self.render.chat_logprobs(lps, s.params.logprobs) if s.logprobs is not None else None,
                              "finish_reason": reason}
                else:
                    choice = {"index": s.index, "text": text,
                              "logprobs": (self.render.completion_logprobs(lps, text_offsets[s.index], s.params.logprobs)
                                           if s.logprobs is not None else None),
                              "finish_reason": s.finish_reason}
                    text_offsets[s.index] += len(text)
                if s.finished:
                    choice["stop_reason"] = s.stop_reason
                    if s.activations:             # activation captures, on the choice's last chunk
                        choice["activations"] = activations_json(s.activations)
                yield chunk([choice])
            if include_usage:
                yield chunk([], self.render.usage(group.seqs, prompts, req))
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"
        except (EngineDeadError, ServerStopping) as e:
            yield f"data: {json.dumps(error_body(str(e), 'service_unavailable'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:                                  # a disconnect lands here too: abort, free blocks
            group.close()

# -- the ASGI app ----------------------------------------------------------------------

def build_app(server: Server) -> FastAPI:
    """The routes; ``run_server`` starts and stops the engine around serving."""
    app = FastAPI(title="fdx", version=fdx_version())
    app.router.redirect_slashes = False       # /tokenize/ is a 404 naming /tokenize, not a 307 to it
    edge.install(app, server.sc)              # API key, body limit, OpenAI-shaped errors

    @app.get("/health")
    async def health():
        if server.sc.health_access == "off":
            raise StarletteHTTPException(404, "Not Found")
        if server.engine.dead:
            why = "the engine process stopped responding" if server.engine.hung else "the engine process died"
            return JSONResponse(error_body(why, "service_unavailable"), status_code=503)
        if server.engine.long_step_s is not None:
            return JSONResponse(error_body(
                f"an engine step has run for {server.engine.long_step_s:.0f} s (engine_step_timeout_s="
                f"{server.sc.engine_step_timeout_s:g}): every stream waits on it", "service_unavailable",
                code="engine_step_timeout"), status_code=503)
        if not server.accepting:
            return JSONResponse(error_body("loading" if server.loading else "not ready", "service_unavailable",
                                           code="loading" if server.loading else None), status_code=503)
        return {"status": "ok"}

    @app.get("/load")
    async def load():                     # what a router pairs instances by (entrypoints/serving/router.py)
        cfg = server.config            # the role and address of a connector that pairs instances (splitwise)
        sw = cfg.plugins.get("connector", {}).get(cfg.cache.kv_connector or "", {}) or {}
        role = sw.get("role", "mixed")
        return {"role": role, "connector": f"tcp://{sw.get('host', '127.0.0.1')}:{sw.get('port', 0)}"
                if role == "decode" else None, "in_flight": len(server.groups), "queued": server.num_queued,
                **({"data_parallel": server.engine.describe()} if cfg.parallel.data_parallel_size > 1 else {})}

    @app.get("/version")
    async def version():
        return {"version": fdx_version()}

    @app.get("/metrics")
    async def metrics():
        if server.sc.metrics_access == "off":
            raise StarletteHTTPException(404, "Not Found")
        server.metrics.observe_engine_process(server.engine)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        base = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "fdx",
                "root": server.config.model.model or DEFAULT_MODEL_NAME, "parent": None,
                "max_model_len": server.max_model_len}
        adapters = [{"id": name, "object": "model", "created": server.created, "owned_by": "fdx", "root": path,
                     "parent": server.model_name, "max_model_len": server.max_model_len}
                    for name, path in server.loras.items()]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(http_request: Request):
        body = await lora_body(http_request, ("lora_name", "lora_path"))
        name, path = body["lora_name"], body["lora_path"]
        if name in server.names:
            raise APIError(400, f"the LoRA adapter name {name!r} is the served model's name", param="lora_name")
        if name in server.loras:
            raise APIError(400, f"the LoRA adapter {name!r} is already loaded", param="lora_name")
        refused = await server.engine.lora(name, path)
        if refused is not None:
            raise APIError(refused.status, refused.message, param="lora_path" if refused.status == 400 else None)
        server.loras[name] = path
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(http_request: Request):
        body = await lora_body(http_request, ("lora_name",), optional=("lora_int_id",))
        name = body["lora_name"]
        if name not in server.loras:
            raise APIError(404, f"the LoRA adapter {name!r} does not exist", param="lora_name",
                           code="model_not_found")
        refused = await server.engine.lora(name, None)
        if refused is not None:
            raise APIError(refused.status, refused.message, param="lora_name")
        del server.loras[name]
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    async def lora_body(http_request: Request, required: tuple[str, ...], optional: tuple[str, ...] = ()):
        """vLLM's load/unload body: string fields, a 400 naming a missing or unknown one."""
        if not server.config.lora.enable_lora:
            raise APIError(400, "this server runs without LoRA adapters (start it with --enable-lora)",
                           code="lora_disabled")
        try:
            body = json.loads(await http_request.body() or b"null")
        except ValueError:
            raise APIError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        unknown = sorted(set(body) - set(required) - set(optional))
        if unknown:
            raise APIError(400, f"unknown field {unknown[0]!r}", param=unknown[0])
        for key in required:
            if not isinstance(body.get(key), str) or not body[key]:
                raise APIError(400, f"{key} must be a non-empty string", param=key)
        return body

    # the bodies are read, size-checked and validated by edge.read_request (large ones off the event
    # loop), not by FastAPI's body parameter; /openapi.json still describes them (openapi_bodies)
    @app.post("/v1/completions")
    async def completions(http_request: Request):
        req = await edge.read_request(http_request, CompletionRequest, server.sc)
        return await server.completions(req, http_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request):
        req = await edge.read_request(http_request, ChatCompletionRequest, server.sc)
        return await server.chat_completions(req, http_request)

    tokenizing.install(app, server)           # /tokenize, /detokenize (vLLM's shapes)
    pooling.install(app, server)              # /v1/embeddings (model.task embed)
    ui.install(app, server)                   # the page at / and /v1/engine/stats (server.ui)
    openapi_bodies(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                         "/v1/embeddings": pooling.EmbeddingRequest})
    return app


def openapi_bodies(app: FastAPI, bodies: dict[str, type]) -> None:
    """Put the request schemas of endpoints that read their own body into
    /openapi.json (as FastAPI writes those of typed body parameters)."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi


def _bind(host: str, port: int):
    import socket
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def run_server(config: FdxConfig) -> int:
    """Start the engine, then serve until SIGTERM / Ctrl-C (exit 0) or until
    the engine dies (exit 1). Start-up problems exit 1 with a one-line message."""
    import sys

    import uvicorn

    try:                                      # a bad model path fails now, before anything starts
        check_model_path(config.model.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"fdx: error: {e}", file=sys.stderr)
        return 1
    from fdx.core.procs import stacks_on_sigusr1
    stacks_on_sigusr1()                       # kill -USR1: every thread's stack to the log
    server = Server(config)
    app = build_app(server)
    uv_config = uvicorn.Config(app, host=config.server.host, port=config.server.port,
                               log_level=config.server.log_level, access_log=config.server.access_log,
                               timeout_graceful_shutdown=10, lifespan="off",
                               http=edge.capped_http_protocol(edge.connection_cap(config.server.max_connections),
                                                               config.server.header_timeout_s,
                                                               config.server.socket_send_buffer_bytes,
                                                               config.server.body_timeout_s))
    edge.quiet_accept_errors()
    warning = security.exposure_warning(config.server)
    if warning:
        log.warning("%s", warning)
        print(f"fdx serve: warning: {warning}", file=sys.stderr, flush=True)
    try:                                      # fail on a busy port now, not after loading the model
        sock = _bind(config.server.host, config.server.port)
    except OSError as e:
        print(f"fdx: error: cannot listen on {config.server.host}:{config.server.port}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    uv = GracefulServer(uv_config, on_signal=server.begin_shutdown)
    server.uvicorn = uv

    async def main() -> int:
        # serve from the start, so /health answers 503 "loading" while the engine loads and warms
        url = f"http://{config.server.host}:{sock.getsockname()[1]}"
        serving = asyncio.ensure_future(uv.serve(sockets=[sock]))
        starting = asyncio.ensure_future(server.startup())
        log.info("loading %s; %s/health answers 503 until it is ready", server.model_name, url)
        await asyncio.wait({serving, starting}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():                   # stopped (SIGTERM, Ctrl-C) while loading
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await server.engine.shutdown()
            return 0
        if starting.exception() is not None:
            print(f"fdx: error: {user_message(starting.exception())}", file=sys.stderr)
            uv.should_exit = True
            await asyncio.gather(serving, return_exceptions=True)
            return 1
        try:
            pids = getattr(server.engine, "pids", None) if config.parallel.data_parallel_size > 1 else None
            print(f"fdx serve: {server.model_name} at {url}/v1 (engine pid"
                  f"{'s ' + ', '.join(map(str, pids)) if pids else ' ' + str(server.engine.pid)})", flush=True)
            await serving
        finally:
            await server.shutdown()
        return server.exit_code

    try:
        return asyncio.run(main())
    finally:
        sock.close()
