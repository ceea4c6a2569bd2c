"""The default token processor: append, detokenize, record logprobs, stop."""
from __future__ import annotations

import time

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import TokenProcessor
from fdx.core.request import Request, RequestStatus, TokenLogprob
from fdx.core.output import TextOutput


class DefaultTokenProcessor(TokenProcessor):
    def start(self, request: Request) -> None:
        """Attach per-request state (called when the engine accepts it)."""
        sp = request.sampling_params
        request.detokenizer = TextOutput(self.tokenizer, sp) if sp.detokenize else None
        request.logprobs = [] if sp.logprobs is not None else None

    def process(self, request: Request, token_id: int, logprobs=None) -> bool:
        sp = request.sampling_params
        if request.detokenizer is None and sp.detokenize:
            self.start(request)
        now = time.monotonic()
        if request.first_token_time is None:
            request.first_token_time = now
        request.output_token_ids.append(token_id)
        if request.logprobs is not None and logprobs is not None:
            request.logprobs.append(self._logprob_dict(logprobs))

        n_out = request.num_output_tokens
        status, reason = None, None
        if n_out >= sp.min_tokens:
            if token_id in request.eos_token_ids and not sp.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token_id in sp.stop_token_ids:
                status, reason = RequestStatus.FINISHED_STOPPED, token_id
        text = request.detokenizer
        if text is not None:
            stop = text.add(token_id, n_out, check_stop=status is None)
            if stop is not None:
                status, reason = RequestStatus.FINISHED_STOPPED, stop
        if status is None and (n_out >= request.max_tokens or request.num_tokens >= request.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if text is not None:
            if status is not None and not isinstance(reason, str):
                text.finish()                  # not cut by a stop string: flush an incomplete tail
            request.output_text = text.text
        if status is not None:
            request.status = status
            request.stop_reason = reason
            request.finished_time = now
            return True
        return False

    def add_prompt_logprobs(self, request: Request, start: int, entries) -> None:
        """Entries for prompt tokens start+1, ... (recomputed ones overwrite)."""
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * request.num_prompt_tokens
        for i, lp in enumerate(entries, start=start + 1):
            if i < request.num_prompt_tokens:
                request.prompt_logprobs[i] = self._logprob_dict(lp)

    def _logprob_dict(self, lp) -> dict[int, TokenLogprob]:
        out: dict[int, TokenLogprob] = {}
        decode = self.tokenizer.decode
        for rank, (tid, val) in enumerate(lp.top, start=1):
            out[int(tid)] = TokenLogprob(int(tid), float(val), rank, decode([int(tid)], skip_special_tokens=False))
        if lp.token_id not in out:
            out[int(lp.token_id)] = TokenLogprob(int(lp.token_id), float(lp.logprob), int(lp.rank),
                                                 decode([int(lp.token_id)], skip_special_tokens=False))
        return out


@hookimpl
def fdx_register_token_processors(register):
    register("default", DefaultTokenProcessor)
