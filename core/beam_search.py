"""Beam search over the engine (``LLM.beam_search``, as vLLM's): each step
runs every live beam of every prompt one token further in one batch, with
the top ``2 * beam_width`` logprobs of its next token; each prompt keeps
its ``beam_width`` best continuations by cumulative logprob, and a beam
that draws an end-of-sequence token is finished. The answer holds each
prompt's finished and live beams, best first by
``cum_logprob / len(tokens) ** length_penalty``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generator

from fdx.core.sampling_params import SamplingParams

MAX_BEAM_WIDTH = 10            # the top 2 * beam_width logprobs a step reads are bounded at 20


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0           # the logprobs are of the raw logits (greedy scores), as in vLLM
    length_penalty: float = 1.0        # the final ranking's exponent on the sequence length

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"invalid beam search parameter beam_width={self.beam_width!r}: an integer in "
                             f"[1, {MAX_BEAM_WIDTH}]")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"invalid beam search parameter max_tokens={self.max_tokens!r}: an integer >= 1")


@dataclass(slots=True)
class BeamSearchSequence:
    tokens: list[int]                  # the prompt's tokens, then the generated ones
    cum_logprob: float = 0.0           # of the generated tokens
    logprobs: list[float] = field(default_factory=list)   # each generated token's
    text: str | None = None            # the whole sequence decoded (set on the answer)
    finish_reason: str | None = None   # "stop" (an eos token) or "length"


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # beam_width of them, best first


def beam_score(seq: BeamSearchSequence, eos_token_ids, length_penalty: float) -> float:
    """vLLM's ranking: the cumulative logprob over the length (without a
    final eos) to the ``length_penalty``."""
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos_token_ids else 0)
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


Scores = list[dict[int, float]]     # per sequence scored: {token id: logprob} of its next token's top ones


def step_params(params: BeamSearchParams) -> SamplingParams:
    """The one-token request each live beam runs per step."""
    return SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                          ignore_eos=True, detokenize=False)


def search(prompts: list[list[int]], params: BeamSearchParams, eos_token_ids
           ) -> Generator[list[list[int]], Scores, list[list[BeamSearchSequence]]]:
    """The search, apart from how a step runs: yields the token ids of every
    live beam (all prompts in one batch), is sent back each one's next-token
    top logprobs (``step_params``), and returns each prompt's best beams
    (``text`` unset). ``LLM.beam_search`` drives it with ``LLM.generate``,
    the server (``use_beam_search``) with engine requests."""
    eos = frozenset(eos_token_ids)
    beams = [[BeamSearchSequence(tokens=list(ids))] for ids in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        live = [(i, b) for i, bs in enumerate(beams) for b in bs]
        if not live:
            break
        scores = yield [b.tokens for _, b in live]
        grown: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), top in zip(live, scores):
            for token_id, lp in top.items():
                new = BeamSearchSequence([*beam.tokens, token_id], beam.cum_logprob + lp, [*beam.logprobs, lp])
                if token_id in eos and not params.ignore_eos:
                    new.finish_reason = "stop"
                    done[i].append(new)
                else:
                    grown[i].append(new)
        # the best beam_width continuations by cumulative logprob (ties: the order they came in)
        beams = [sorted(g, key=lambda s: -s.cum_logprob)[:params.beam_width] for g in grown]
    answers = []
    for i in range(len(prompts)):
        for b in beams[i]:
            b.finish_reason = "length"
        best = sorted(done[i] + beams[i], key=lambda s: -beam_score(s, eos, params.length_penalty))
        answers.append(best[:params.beam_width])
    return answers


def beam_search(llm, prompts: list[Any], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """``prompts``: strings or ``{"prompt_token_ids": [...]}`` dicts."""
    tok = llm.tokenizer
    ids = [tok.encode(p) if isinstance(p, str) else list(p["prompt_token_ids"]) for p in prompts]
    run, step = search(ids, params, llm.engine.eos_token_ids), step_params(params)
    try:
        batch = next(run)
        while True:
            outs = llm.generate([{"prompt_token_ids": b} for b in batch], step)
            batch = run.send([{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs])
    except StopIteration as end:
        answers = end.value
    for best in answers:
        for s in best:
            s.text = tok.decode(s.tokens, skip_special_tokens=True)
    return [BeamSearchOutput(best) for best in answers]
