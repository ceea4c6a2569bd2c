"""Rendering: chat messages into a prompt, and engine results into OpenAI's
response bodies (choices, usage, the two logprobs shapes)."""
from __future__ import annotations

import json

from fdx.core.output import token_text
from fdx.entrypoints.serving.protocol import APIError


class Renderer:
    # a text this many characters per allowed token is checked on its head first (see _encode)
    CHARS_PER_TOKEN_BOUND = 8

    def __init__(self, tokenizer, model_name: str, max_prompt_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_prompt_tokens = max_prompt_tokens

    def _encode(self, text: str, param: str, **kw) -> list[int]:
        """Tokenize, refusing a text far too long without tokenizing it all:
        tokenizing blocks this process (4 MB of text: seconds), and no token
        of it could be used. A head of the text that alone has more tokens
        than the context is proof enough."""
        self._refuse_long(text, param, **kw)
        return self.tokenizer.encode(text, **kw)

    def _refuse_long(self, text: str, param: str, **kw) -> None:
        limit = self.max_prompt_tokens
        head_len = None if limit is None else self.CHARS_PER_TOKEN_BOUND * limit
        if head_len is not None and len(text) > head_len:
            head = self.tokenizer.encode(text[:head_len], **kw)
            if len(head) > limit + 16:            # + a margin for a token cut at the seam
                raise APIError(400, f"the prompt has more than {limit} tokens (its first {head_len} characters "
                               f"alone are {len(head)} tokens of {len(text)} characters), but this model's "
                               f"maximum context length (max_model_len) is {limit}", param=param,
                               code="context_length_exceeded")

    # -- special-token text in message content (server.content_special_tokens, docs/security.md) ------
    _plain = None                                 # the tokenizer's copy that reads special-token text as text
    _special_texts: tuple[str, ...] | None = None

    def special_texts(self) -> tuple[str, ...]:
        """The text of every special token (``<|im_start|>``, ``</s>``, ...)."""
        if self._special_texts is None:
            added = self.tokenizer.backend.get_added_tokens_decoder().values()
            self._special_texts = tuple(sorted({t.content for t in added if t.special and t.content}))
        return self._special_texts

    def _encode_plain(self, text: str) -> list[int]:
        if self._plain is None:
            from tokenizers import Tokenizer as Backend
            plain = Backend.from_str(self.tokenizer.backend.to_str())
            plain.encode_special_tokens = True    # "<|im_end|>" becomes "<", "|", "im", ... : plain text
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    def _encode_content_as_text(self, text: str, contents: list[str]) -> list[int]:
        """The rendered chat ``text`` tokenized with the template's own special
        tokens as special tokens, and the messages' content as text: a user
        who writes ``<|im_end|>\\n<|im_start|>system`` gets those characters,
        not a forged system turn. Each content that holds special-token text
        is found in the text (in order) and encoded on its own."""
        specials = self.special_texts()
        self._refuse_long(text, "messages", add_special_tokens=False)
        ids: list[int] = []
        pos = 0
        for content in contents:
            if not content or not any(sp in content for sp in specials):
                continue
            at = text.find(content, pos)
            if at < 0:
                raise APIError(400, "a message's content holds special-token text, which this server encodes "
                               "as plain text (content_special_tokens 'text'), but the chat template changed "
                               "that content, so fdx cannot tell it from the template's own tokens",
                               param="messages")
            ids += self.tokenizer.encode(text[pos:at], add_special_tokens=False) + self._encode_plain(content)
            pos = at + len(content)
        return ids + self.tokenizer.encode(text[pos:], add_special_tokens=False)

    # -- input ---------------------------------------------------------------------------
    def chat_prompt(self, req, content_as_text: bool = False) -> tuple[str, list[int]]:
        """The chat template applied to the request's messages: (text, token
        ids). ``content_as_text``: special-token text inside the messages'
        content is tokenized as plain text (_encode_content_as_text)."""
        messages = []
        for m in req.messages:
            msg = {k: v for k, v in m.model_dump().items() if v is not None}
            msg["content"] = m.text() or ""
            if isinstance(msg.get("tool_calls"), list):
                msg["tool_calls"] = [_template_call(c) for c in msg["tool_calls"]]
            messages.append(msg)
        template_kwargs = req.chat_template_kwargs or {}
        reserved = sorted(set(template_kwargs) & {"chat_template", "tools", "documents", "messages",
                                                  "add_generation_prompt"})
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}",
                           param="chat_template_kwargs")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tools=getattr(req, "tools", None) or None,
                **template_kwargs)
        except Exception as e:  # template errors (raise_exception, a missing template)
            raise APIError(400, f"cannot render the chat template: {e}", param="messages") from None
        if content_as_text:
            return text, self._encode_content_as_text(text, [m["content"] for m in messages])
        return text, self._encode(text, "messages", add_special_tokens=False)

    def completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            return [(prompt, self._encode(prompt, "prompt"))]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [(None, list(prompt))]
        if all(isinstance(p, str) for p in prompt):
            return [(p, self._encode(p, "prompt")) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return [(None, list(p)) for p in prompt]
        raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                       "lists of token ids", param="prompt")

    # -- output ---------------------------------------------------------------
    def usage(self, seqs, prompts, req=None) -> dict:
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        scores_only = getattr(req, "scores_only", lambda: False)()     # its one computed token is not shown
        completion = 0 if scores_only else sum(len(s.token_ids) for s in seqs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def prompt_text(self, prompts, p_idx: int) -> str:
        text, ids = prompts[p_idx]
        return text if text is not None else self.tokenizer.decode(ids, skip_special_tokens=False)

    def final_response(self, seqs, req, prompts, rid, created, chat) -> dict:
        choices = []
        for s in seqs:
            lps = s.take_logprobs()
            if chat:
                message = s.chat_message() or {"role": "assistant", "content": s.text}   # as LLM.chat's
                reason = s.chat_finish_reason()
                choices.append({"index": s.index, "message": message,
                                "logprobs": self.chat_logprobs(lps, s.params.logprobs) if s.logprobs is not None else None,
                                "finish_reason": reason, "stop_reason": s.stop_reason})
            else:
                scores_only = req.scores_only()
                echoed = self.prompt_text(prompts, s.prompt_index) if req.echo else ""
                text = echoed + ("" if scores_only else s.text)
                logprobs = None
                if s.logprobs is not None:
                    logprobs = self.completion_logprobs([] if scores_only else lps, len(echoed), s.params.logprobs)
                    if req.echo:                  # the prompt's tokens first (the first one has none)
                        head = self.prompt_completion_logprobs(s, s.params.logprobs)
                        logprobs = {k: head[k] + logprobs[k] for k in logprobs}
                choice = {"index": s.index, "text": text, "logprobs": logprobs,
                          "finish_reason": "length" if scores_only else s.finish_reason,
                          "stop_reason": None if scores_only else s.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.vllm_prompt_logprobs(s)
                choices.append(choice)
            if s.activations:                    # SamplingParams.activations captures (docs/serving.md)
                choices[-1]["activations"] = activations_json(s.activations)
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": self.usage(seqs, prompts, req)}
        if chat and req.prompt_logprobs is not None:      # vLLM: the chat response's, top level
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(seqs[0]) if seqs else None
        return body

    def prompt_completion_logprobs(self, s, top_n: int) -> dict:
        """The echoed prompt's tokens in the legacy completions logprobs shape:
        the first token's logprob (and top) null, as OpenAI's echo gives."""
        entries = s.prompt_logprobs or [None] * len(s.prompt_token_ids)
        out = self.completion_logprobs([(tid, e or []) for tid, e in zip(s.prompt_token_ids, entries)], 0, top_n)
        for i, e in enumerate(entries):
            if e is None:
                out["token_logprobs"][i] = None
                out["top_logprobs"][i] = None
        return out

    def vllm_prompt_logprobs(self, s) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or
        {token id: {logprob, rank, decoded_token}}, the prompt's own token among them."""
        if s.prompt_logprobs is None:
            return None
        return [None if e is None else {str(int(t)): {"logprob": lp, "rank": int(rank),
                                                      "decoded_token": self._token_str(int(t))}
                                        for t, lp, rank in e}
                for e in s.prompt_logprobs]

    # -- logprobs in OpenAI's two shapes ---------------------------------------------------
    def _token_str(self, tid: int) -> str:
        return token_text(self.tokenizer, tid)       # the output processor's logprob text

    def completion_logprobs(self, lps, offset: int, top_n: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entries in lps:
            tok = self._token_str(tid)
            tokens.append(tok)
            token_lps.append(_sampled_logprob(tid, entries))
            tops.append({self._token_str(int(e[0])): e[1] for e in entries[:top_n]} if top_n else None)
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, lps, top_n: int) -> dict:
        content = []
        for tid, entries in lps:
            tok = self._token_str(tid)
            content.append({
                "token": tok, "logprob": _sampled_logprob(tid, entries), "bytes": list(tok.encode()),
                "top_logprobs": [{"token": (t := self._token_str(int(e[0]))), "logprob": e[1],
                                  "bytes": list(t.encode())} for e in entries[:top_n]]})
        return {"content": content}


def _template_call(call):
    """An assistant message's tool call as chat templates read it (as
    vLLM hands it): OpenAI's ``function.arguments`` JSON text as a dict
    (templates write it with ``tojson``)."""
    if not isinstance(call, dict):
        return call
    fn = call.get("function")
    if not isinstance(fn, dict):
        return call
    fn = dict(fn)
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass                          # left as written: the template shows the text
    return {**call, "function": fn}


def _sampled_logprob(tid: int, entries) -> float | None:
    """Entries are [token_id, logprob, rank]: the top-N by rank, then the
    sampled token when it is not among them."""
    return next((e[1] for e in entries if int(e[0]) == tid), None)


def activations_json(captures: list) -> dict:
    """SeqDelta.activations as the response's ``activations``: {"point.layer":
    {"positions": [...], "values": [[float, ...], ...]}}."""
    import numpy as np
    return {key: {"positions": list(positions),
                  "values": np.frombuffer(data, np.float32).reshape(len(positions), hidden).tolist()}
            for key, positions, hidden, data in captures}
