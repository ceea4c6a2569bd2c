"""The default token processor: append, record logprob ids/values, stop.

Stop strings are matched here, where the tokens are made: a request with
``stop`` strings is detokenized incrementally (core/output.py's
``TextOutput``, over the engine's tokenizer), so the token that completes
a stop string is the last one the engine computes. The text callers get is
the output processor's (core/output.py), for ``LLM`` and the server alike."""
from __future__ import annotations

import time

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import TokenProcessor
from fdx.core.request import Request, RequestStatus, TokenLogprob


class DefaultTokenProcessor(TokenProcessor):
    def start(self, request: Request) -> None:
        """Attach per-request state (called when the engine accepts it)."""
        sp = request.sampling_params
        request.logprobs = [] if sp.logprobs is not None else None
        if sp.stop:
            # imported here: fdx.core.output pulls in the tokenizer module, which the serving engine
            # process never imports for a request without stop strings (tests/test_tokenizer.py)
            from fdx.core.output import TextOutput
            request.stop_text = TextOutput(self.tokenizer, sp)
        else:
            request.stop_text = None

    def process(self, request: Request, token_id: int, logprobs=None) -> bool:
        sp = request.sampling_params
        now = time.monotonic()
        if request.first_token_time is None:
            request.first_token_time = now
        request.output_token_ids.append(token_id)
        if request.logprobs is not None and logprobs is not None:
            request.logprobs.append(_logprob_dict(logprobs))

        n_out = request.num_output_tokens
        status, reason = None, None
        if n_out >= sp.min_tokens:
            if token_id in request.eos_token_ids and not sp.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token_id in sp.stop_token_ids:
                status, reason = RequestStatus.FINISHED_STOPPED, token_id
        if status is None and request.stop_text is not None:
            stop = request.stop_text.add(token_id, n_out)   # min_tokens is its to check
            if stop is not None:
                status, reason = RequestStatus.FINISHED_STOPPED, stop
        if status is None and (n_out >= request.max_tokens or request.num_tokens >= request.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            request.status = status
            request.stop_reason = reason
            request.finished_time = now
            request.stop_text = None
            return True
        return False

    def add_prompt_logprobs(self, request: Request, start: int, entries) -> None:
        """Entries for prompt tokens start+1, ... (recomputed ones overwrite)."""
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * request.num_prompt_tokens
        for i, lp in enumerate(entries, start=start + 1):
            if i < request.num_prompt_tokens:
                request.prompt_logprobs[i] = _logprob_dict(lp)


def _logprob_dict(lp) -> dict[int, TokenLogprob]:
    """{token id: TokenLogprob} by rank, the sampled token last when it is
    not among the top; ``decoded`` is left for the output processor."""
    out: dict[int, TokenLogprob] = {}
    for rank, (tid, val) in enumerate(lp.top, start=1):
        out[int(tid)] = TokenLogprob(int(tid), float(val), rank)
    if lp.token_id not in out:
        out[int(lp.token_id)] = TokenLogprob(int(lp.token_id), float(lp.logprob), int(lp.rank))
    return out


@hookimpl
def fdx_register_token_processors(register):
    register("default", DefaultTokenProcessor)
