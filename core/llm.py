"""The Python API: ``LLM(...).generate()`` and ``.chat()``, engine in-process."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

from fdx.core.activations import collect
from fdx.core.config import FdxConfig
from fdx.core.engine import EngineCore
from fdx.core.output import OutputProcessor, SequenceState, logprob_dict, split_n
from fdx.core.request import CompletionOutput, Request, RequestOutput
from fdx.core.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


@dataclasses.dataclass(slots=True)
class EmbeddingOutput:
    """``LLM.embed``'s answer for one prompt (vLLM's ``EmbeddingRequestOutput``,
    with the vector at ``.embedding``)."""
    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]

    @property
    def outputs(self) -> "EmbeddingOutput":
        """vLLM's spelling, ``out.outputs.embedding``."""
        return self


class LLM:
    """An engine in this process.

    ``LLM()`` serves the embedded SmolLM2-135M-Instruct; ``LLM("dir")`` a
    Hugging Face checkpoint; ``LLM("model.gguf")`` a GGUF file. Keyword
    arguments are config keys (flat, like ``max_num_seqs``, or dotted, like
    ``cache.block_size``); ``config=`` names a YAML file.
    """

    def __init__(self, model: str | None = None, *, config: str | FdxConfig | None = None,
                 progress: bool = True, plugins=None, **overrides: Any):
        from fdx.core.logs import configure_api
        configure_api()                      # fdx's one log format, unless the program set up logging
        if isinstance(config, FdxConfig):
            cfg = config if model is None and not overrides else FdxConfig.build(
                **config.model_dump(), **({"model": model} if model else {}), **overrides)
        else:
            cfg = FdxConfig.build(config, **({"model": model} if model else {}), **overrides)
        self.engine = EngineCore(cfg, plugins=plugins, progress=progress)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self, chat: bool = False) -> SamplingParams:
        """What ``generate`` (chat=False) and ``chat`` (chat=True) use when given
        no SamplingParams: the model's generation defaults (generation_config.json,
        GGUF ``general.sampling.*``), and for chat fdx's chat defaults for the
        model under them (core/generation.py). A SamplingParams passed in is
        used as it is."""
        from fdx.core.generation import CHAT_DEFAULTS, defaults_for
        return SamplingParams(**defaults_for(getattr(self.engine, "generation_config", {}), chat,
                                             getattr(self.engine, "chat_defaults", CHAT_DEFAULTS)))

    def close(self) -> None:
        """Flush the KV cache's tiers and drop pending work."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- generate ------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request: Any = None) -> list[RequestOutput]:
        """``lora_request``: a fdx.core.lora.LoRARequest for every prompt, or a
        list of them (None entries: the base model), as vLLM's (docs/lora.md)."""
        return self._run(self._stage_all(prompts, sampling_params, lora_request), use_tqdm)

    def _stage_all(self, prompts, sampling_params, lora_request=None) -> list[list[Request]]:
        """generate's checks and each prompt's engine requests (not yet added)."""
        if self.engine.task == "embed":
            raise ValueError("this LLM runs model.task=embed: it embeds (LLM.embed), it does not generate; "
                             "build it with task='generate' to generate")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params(chat=False)
        params = self._params_list(sampling_params, len(prompts))
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_request entries for {len(prompts)} prompts")
        # validate everything before queueing anything
        return [self._stage(p, sp, lr) for p, sp, lr in zip(prompts, params, loras)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
             reasoning_max_tokens: int | None = None) -> list[RequestOutput]:
        """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as OpenAI's
        (``required`` and a named function are guaranteed by guided decoding;
        ``auto`` needs ``server.tool_call_parser`` and
        ``server.enable_auto_tool_choice``); with tools or a
        ``server.reasoning_parser``, each output's ``message`` is the
        assistant message the server answers (content, tool_calls,
        reasoning_content), from the same parsers (core/chat_output.py)."""
        from types import SimpleNamespace

        from fdx.core.chat_output import chat_parser, choice_outputs, tool_plan
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        plan = tool_plan(SimpleNamespace(tools=tools, tool_choice=tool_choice,
                                         parallel_tool_calls=parallel_tool_calls), self.config.server)
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tools=tools or None, **(chat_template_kwargs or {}))
            # the template already holds the special tokens
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params(chat=True)
        plugins = self.engine.plugins
        tool_parser = chat_parser(plugins, self.config, "tool_parser", "tool_call_parser")
        reasoning = chat_parser(plugins, self.config, "reasoning_parser", "reasoning_parser")
        params = self._params_list(sampling_params, len(prompts))
        makers = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            kwargs = sp.to_dict()
            makers.append(choice_outputs(plan, p["prompt"], kwargs, self.tokenizer, tool_parser, reasoning,
                                         reasoning_max_tokens))
            params[i] = SamplingParams(**kwargs)
        # each choice gets its parsers, as the server's do (the output processor's SequenceState)
        return self._run(self._stage_all(prompts, params), use_tqdm, makers)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params) -> list:
        """vLLM's ``LLM.beam_search``: ``params`` a ``BeamSearchParams``
        (beam_width, max_tokens, ignore_eos, temperature, length_penalty);
        one ``BeamSearchOutput`` per prompt, its ``sequences`` best first
        (``tokens`` with the prompt's, ``text``, ``cum_logprob``). See
        core/beam_search.py."""
        from fdx.core.beam_search import beam_search
        if self.engine.task == "embed":
            raise ValueError("this LLM runs model.task=embed: it does not generate")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return beam_search(self, list(prompts), params)

    def embed(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = False) -> list[EmbeddingOutput]:
        """One embedding per prompt (strings or ``{"prompt_token_ids": [...]}``),
        in order: the model's final hidden states pooled as
        ``model.pooling_type`` says (last token or mean), L2-normalized with
        ``model.normalize``. Needs ``task="embed"``."""
        if self.engine.task != "embed":
            raise ValueError("LLM.embed needs model.task=embed: build it with LLM(..., task='embed')")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        staged = [self._stage(p, SamplingParams()) for p in prompts]
        self._run(staged, use_tqdm)
        return [EmbeddingOutput(group[0].request_id, group[0].prompt_token_ids, group[0].pooled.tolist())
                for group in staged]

    # -- internals ----------------------------------------------------------------
    @staticmethod
    def _params_list(sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling_params for {n} prompts")
        return sp

    def _stage(self, prompt: PromptType, sp: SamplingParams, lora_request: Any = None) -> list[Request]:
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"unknown prompt key(s): {', '.join(sorted(unknown))}")
            text = prompt.get("prompt")
            ids = prompt.get("prompt_token_ids")
            if ids is None:
                if not isinstance(text, str):
                    raise ValueError("a prompt dict needs 'prompt' (str) or 'prompt_token_ids' (list of int)")
                ids = self.tokenizer.encode(text)
            ids = list(ids)
        else:
            raise TypeError(f"a prompt must be a str or a dict, not {type(prompt).__name__}")
        eng = self.engine
        # compile now: a bad constraint raises here, with the compiler's message (add_request then
        # finds the compiled one in the engine's compile cache: one compile)
        eng.guided.validate(sp)
        base = eng.new_request_id()
        children = split_n(sp)                  # the one n / seed rule (core/output.py), as the server's
        return [eng.make_request(ids, child, request_id=base if sp.n == 1 else f"{base}-{i}", prompt=text,
                                 lora_request=lora_request)
                for i, child in enumerate(children)]

    def _run(self, staged: list[list[Request]], use_tqdm: bool, chat_outputs: list | None = None) -> list[RequestOutput]:
        """``chat_outputs``: per prompt, the factory of a choice's chat parsers
        (core/chat_output.py's choice_outputs) or None."""
        eng = self.engine
        outputs = OutputProcessor(eng)          # text, stop strings, logprob text: not the engine's
        added = []
        try:
            for g, group in enumerate(staged):
                make = chat_outputs[g] if chat_outputs is not None else None
                for i, req in enumerate(group):
                    eng.add_request(req)        # a LoRA adapter that cannot load is refused here
                    added.append(req.request_id)
                    outputs.add(req, index=i, chat_output=make() if make is not None else None)
        except BaseException:
            for rid in added:
                eng.abort_request(rid)
            raise
        pending = {req.request_id for group in staged for req in group}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(pending), desc="requests", unit="req")
        try:
            while pending:
                for seq in outputs.process(eng.step()):
                    if seq.request_id in pending:
                        pending.discard(seq.request_id)
                        if bar:
                            bar.update(1)
            rm = eng.scheduling
            while eng.has_unfinished() and not (rm.num_running or rm.num_waiting):
                eng.step()                 # only KV transfers left (a connector saving blocks)
        except BaseException:
            for rid in pending:          # leave the engine clean on Ctrl-C or errors
                eng.abort_request(rid)
            raise
        finally:
            if bar:
                bar.close()
        return [self._output(group, [outputs.pop(r.request_id) for r in group]) for group in staged]

    def _output(self, group: list[Request], seqs: list[SequenceState]) -> RequestOutput:
        first = group[0]
        tok = self.tokenizer
        outs = []
        for req, s in zip(group, seqs):
            message = s.chat_message()          # first: the finish reason depends on the calls it found
            outs.append(CompletionOutput(
                index=s.index, text=s.text, token_ids=list(s.token_ids), finish_reason=s.chat_finish_reason(),
                stop_reason=s.stop_reason, activations=collect(req.activations), message=message,
                logprobs=None if s.logprobs is None else [logprob_dict(tok, rows) for rows in s.logprobs]))
        prompt_lps = seqs[0].prompt_logprobs
        if prompt_lps is not None:
            prompt_lps = [logprob_dict(tok, rows) for rows in prompt_lps]
        base_id = first.request_id.rsplit("-", 1)[0] if len(group) > 1 else first.request_id
        return RequestOutput(
            request_id=base_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=outs, finished=all(s.finished for s in seqs),
            num_cached_tokens=first.num_cached_tokens, prompt_logprobs=prompt_lps,
            metrics={"arrival_time": first.arrival_time, "first_token_time": first.first_token_time,
                     "finished_time": first.finished_time})
