"""The ``draft_model`` proposer (vLLM's ``draft_model``, llama.cpp's
``--model-draft``): a second, smaller model sharing the target's tokenizer
drafts k tokens greedily, one forward a token, in the engine's process.

The draft is loaded as the target is (any checkpoint fdx loads: an HF
folder or a GGUF file, ``speculative.model``; ``"self"`` drafts with the
target's own checkpoint) on a backend of its own kind set up here, with
its own paged KV cache of ``cache.num_kv_blocks`` blocks (plus room for
each request's drafts) and its own block tables. Per request it keeps the
tokens whose KV its cache holds: each ``propose`` first computes the
tokens the target added since (the accepted drafts and the target's own
token; the whole prompt, in chunks, the first time), then drafts. A
rejected draft's KV is dropped by ``on_accepted`` (the positions past the
kept prefix are overwritten next time), a preempted or finished request's
blocks are freed. Whatever the bookkeeping says, a position is reused only
while its token equals the request's token there, so the draft's KV never
disagrees with the request.

Drafts are the draft's argmax, proposed as deterministic (no
``draft_probs``): the engine's verification keeps the target's output
distribution exactly (for a seeded request, its tokens) whatever the
draft proposes. Self-drafting with the target accepts every draft of a
greedy request wherever a row's logits do not depend on the rows beside it
(float32; the embedded Q4_1 model's kernels are not yet batch-invariant:
99.5% there, docs/benchmarks.md).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fdx.core.config import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import AttentionContext, BatchLayout, KVCacheSpec, Proposal, Proposer, SamplingBatch

log = logging.getLogger("fdx.spec")

KEY = "speculative.model"


@dataclass(slots=True)
class _Seq:
    tokens: list[int] = field(default_factory=list)      # the tokens whose KV the draft's cache holds
    blocks: list[int] = field(default_factory=list)
    proposed_from: int = 0                               # len(token_ids) at the last propose
    num_drafts: int = 0                                  # drafts of the last propose
    params: Any = None                                   # its SamplingParams when it samples unseeded


class DraftModelProposer(Proposer):
    uses_sampling_params = True

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        config = self.config
        sc = config.speculative
        path = sc.model
        tp = config.parallel.tensor_parallel_size
        if tp > 1:
            # the draft would run whole in the engine process, beside the ranks on the same cores, and
            # its proposals per request serialize every step: refused rather than left untested
            raise ConfigError(f"config key '{KEY}': method draft_model does not run under tensor parallel "
                              f"(parallel.tensor_parallel_size {tp}); use method ngram or suffix, or "
                              "tensor_parallel_size 1")
        if path is None:
            raise ConfigError(f"config key '{KEY}': method draft_model needs the draft model's path (a Hugging "
                              "Face folder or a .gguf file sharing the target's tokenizer), or \"self\"")
        if path == "self":
            path = config.model.model            # None: the embedded default model, as the target
        elif not Path(path).exists():
            raise ConfigError(f"config key '{KEY}': {path!r} does not exist")
        dconf = config.model_copy(deep=True)
        dconf.model.model = path
        dconf.model.moe_router = None
        self._load(dconf, path, self.vocab_size)
        m = self.model
        self.path = path
        # the KV cache is allocated at the first proposal (allocate): the engine sizes the target's
        # cache first, sharing its budget with this one (kv_bytes)
        self.spec = KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, 0, config.cache.block_size,
                                self.backend.kv_cache_dtype(self.dtype), self.attention.layout)
        self.kv_caches, self.free = None, []
        self.forwards = 0                        # draft forwards run (one a draft position for all requests)
        self.seqs: dict[str, _Seq] = {}
        self.chunk = max(1, config.scheduler.max_num_batched_tokens or 2048)
        self.max_positions = m.max_position_embeddings

    def _room_per_seq(self) -> int:
        """Blocks a request's drafts may need past the target's tokens."""
        return -(-(self.config.speculative.num_speculative_tokens + 1) // self.spec.block_size) + 1

    def kv_bytes(self, block_size: int, max_num_seqs: int) -> tuple[int, int]:
        """(this cache's bytes per target block, its bytes for the drafts'
        room): the engine's KV sizing shares its budget with them."""
        bpb = self.spec.bytes_per_block
        return bpb, max_num_seqs * self._room_per_seq() * bpb

    def allocate(self) -> None:
        """The draft's KV cache: as many tokens as the target's
        (``cache.num_kv_blocks``, resolved by then) plus each request's
        drafts' room."""
        cc, bs = self.config.cache, self.spec.block_size
        num_blocks = (cc.num_kv_blocks or 0) + self.config.scheduler.max_num_seqs * self._room_per_seq()
        s = self.spec
        self.spec = KVCacheSpec(s.num_layers, s.num_kv_heads, s.head_dim, num_blocks, bs, s.dtype, s.layout)
        self.kv_caches = self.backend.allocate_kv_cache(self.spec)
        self.free = list(range(num_blocks - 1, -1, -1))
        log.info("draft model %s: %d layers, KV cache of %d blocks of %d tokens (%.1f MiB)",
                 self.path or "(default)", self.model.num_layers, num_blocks, bs,
                 num_blocks * self.spec.bytes_per_block / (1 << 20))

    def _load(self, dconf, path, vocab_size: int) -> None:
        from fdx.core.assembly import Assembly
        from fdx.model_io.model import load_model
        from fdx.core.engine import select_backend
        from fdx.core.plugins import get_plugin_manager
        plugins = get_plugin_manager()
        self.backend = backend = select_backend(dconf, plugins)
        backend.setup(dconf)
        assembly = Assembly(dconf, plugins, backend)
        want = dconf.model.dtype
        self.dtype = backend.dtypes[0] if want == "auto" else want
        try:
            model, ckpt = load_model(dconf, plugins, backend.kernels, progress=False, defer_tokenizer=True)
        except ConfigError as e:
            raise ConfigError(f"config key '{KEY}': the draft model: {e}") from None
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"config key '{KEY}': the draft model {path!r} does not load: "
                              f"{type(e).__name__}: {e}") from None
        if model.vocab_size != vocab_size:
            raise ConfigError(f"config key '{KEY}': the draft model's vocabulary has {model.vocab_size} tokens, "
                              f"the target's {vocab_size}; a draft model must share the target's tokenizer")
        del ckpt
        _check_tokenizers(self.config.model.model, path)
        backend.prepare_model(model, self.dtype)
        self.model = model
        self.attention = assembly.attention()
        # the distribution a sampled request draws from (temperature, top-k/p, min-p), as the target's
        # verification computes it (Sampler.probs); drafts drawn with the engine's seed
        self.sampler = assembly.make("sampler", "host", key=KEY)
        self.rng = np.random.default_rng([dconf.seed, 37])

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id, prompt_token_ids, sampling_params=None):
        p = sampling_params
        # unseeded sampled requests get drafts drawn from the draft's distribution, with it (exact rejection
        # sampling, more kept than an argmax); greedy and seeded ones the argmax (a seeded request's tokens
        # then stay those without speculation)
        self.seqs[request_id] = _Seq(params=p if p is not None and not p.greedy and p.seed is None else None)

    def on_preempted(self, request_id):
        seq = self.seqs.get(request_id)
        if seq is not None:
            self._truncate(seq, 0)

    def remove_request(self, request_id, output_token_ids):
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._truncate(seq, 0)

    def on_accepted(self, request_id, num_proposed, num_accepted):
        """Keep the KV of the request's tokens and of the drafts kept (the
        last draft was never computed); the rejected positions are dropped."""
        seq = self.seqs.get(request_id)
        if seq is not None and seq.num_drafts:
            kept = min(num_accepted, num_proposed, seq.num_drafts - 1)
            del seq.tokens[seq.proposed_from + kept:]
            seq.num_drafts = 0

    def _truncate(self, seq: _Seq, n: int) -> None:
        del seq.tokens[n:]
        keep = -(-n // self.spec.block_size)
        self.free.extend(reversed(seq.blocks[keep:]))
        del seq.blocks[keep:]

    def _reserve(self, seq: _Seq, num_tokens: int) -> bool:
        need = -(-num_tokens // self.spec.block_size) - len(seq.blocks)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.blocks.append(self.free.pop())
        return True

    # -- drafting ----------------------------------------------------------------------------
    def propose(self, request_id, token_ids, k, hidden_states=None):
        return self.propose_batch([(request_id, token_ids, k)]).get(request_id, [])

    def propose_batch(self, items):
        """Drafts for several requests at once (the engine asks for every
        request that decodes in a step): ``items`` (request id, its tokens,
        k). Each request's catch-up rows (the tokens the target added since)
        go in one forward of the draft for all of them, then each further
        draft token is one forward with one row a request; a request's KV
        and draft are those it would get alone. Returns request id -> drafts
        (a ``Proposal`` with ``draft_probs`` for unseeded sampled requests)."""
        if self.kv_caches is None:
            self.allocate()
        import paddle
        from fdx.core import kernels
        live = []                                # [request id, seq, first position to compute, k]
        for request_id, token_ids, k in items:
            got = self._prepare(request_id, token_ids, k)
            if got is not None:
                live.append([request_id, *got])
        out: dict[str, Any] = {}
        drafts = {rid: [] for rid, *_ in live}
        probs = {rid: [] for rid, *_ in live}
        with kernels.using(self.backend.kernels), paddle.no_grad():
            for entry in live:                   # a long catch-up (the prompt) in chunks, alone, no logits
                rid, seq, start, _ = entry
                while len(seq.tokens) - start > self.chunk:
                    self._forward([(rid, seq, start, start + self.chunk)], logits=False)
                    start += self.chunk
                entry[2] = start
            j = 0
            while live:
                logits = self._forward([(rid, seq, start, len(seq.tokens)) for rid, seq, start, _ in live],
                                       logits=True)
                still = []
                for (rid, seq, start, k), row in zip(live, logits):
                    if seq.params is None:
                        token = int(row.argmax())
                    else:
                        q = self.sampler.probs(row[None], SamplingBatch([seq.params], [()], [()]))[0]
                        cum = np.cumsum(q)
                        token = int(min(np.searchsorted(cum, self.rng.random() * cum[-1], side="right"),
                                        len(q) - 1))
                        probs[rid].append(q)
                    drafts[rid].append(token)
                    if j + 1 < k:
                        still.append([rid, seq, len(seq.tokens), k])
                        seq.tokens.append(token)
                live = still
                j += 1
        for request_id, token_ids, _ in items:
            if request_id not in drafts:
                continue
            seq, d, p = self.seqs[request_id], drafts[request_id], probs[request_id]
            seq.proposed_from, seq.num_drafts = len(token_ids), len(d)
            out[request_id] = Proposal(d, np.stack(p).astype(np.float32)) if p else d
        return out

    def _prepare(self, request_id, token_ids, k):
        """A request's KV made ready to draft ``k`` tokens after
        ``token_ids``: the positions still valid kept, blocks reserved, its
        new tokens appended; (its _Seq, the first position to compute, k),
        or None (no room for a draft, or the pool is short)."""
        seq = self.seqs.setdefault(request_id, _Seq())
        n = len(token_ids)
        k = min(k, self.max_positions - n)
        seq.num_drafts = 0
        if k <= 0:
            return None
        # the KV positions still valid: the longest common prefix, leaving the last token to compute
        have = seq.tokens
        valid = min(len(have), n - 1)
        if have[:valid] != list(token_ids[:valid]):
            valid = next(i for i, (a, b) in enumerate(zip(have, token_ids)) if a != b)
        self._truncate(seq, valid)
        if not self._reserve(seq, n + k - 1):
            self._truncate(seq, 0)               # the pool is short: no drafts, and no KV held
            return None
        seq.tokens.extend(int(t) for t in token_ids[valid:])
        return seq, valid, k

    def _forward(self, parts: list, logits: bool) -> list[np.ndarray]:
        """One forward of the draft over several requests' positions
        (``parts``: request id, its _Seq, first and end position; KV
        written); each part's last row's logits (float32 numpy [vocab]) when
        ``logits``."""
        import paddle
        self.forwards += 1
        ids, starts, lens, rows, row_starts = [], [], [], [], []
        for _, seq, start, end in parts:
            row_starts.append(len(ids))
            ids += seq.tokens[start:end]
            starts.append(start)
            lens.append(end - start)
            rows.append(len(ids) - 1)
        layout = BatchLayout(tuple(p[0] for p in parts), tuple(row_starts), tuple(lens), tuple(starts),
                             tuple(rows) if logits else (), (None,) * len(parts))
        meta = self.attention.build_metadata(lens, starts, [p[1].blocks for p in parts], self.spec,
                                             self.model.num_heads)
        attn = AttentionContext(self.attention, meta, None, layout)
        out = self.model.forward(paddle.to_tensor(np.asarray(ids, dtype=np.int64)), attn.positions,
                                 self.kv_caches, attn, paddle.to_tensor(np.asarray(rows, dtype=np.int64)))
        if not logits:
            return []
        out = (out if out.dtype == paddle.float32 else out.astype("float32")).numpy()
        return list(out)

    def close(self):
        self.kv_caches = []
        self.seqs.clear()


def _vocab_of(path) -> dict | None:
    """A Hugging Face folder's token -> id map (tokenizer.json's model
    vocabulary and added tokens), or None where there is none to read."""
    import json
    if path is None or not (Path(path) / "tokenizer.json").is_file():
        return None
    data = json.loads((Path(path) / "tokenizer.json").read_text())
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, list):                  # unigram: [token, score] pairs
        vocab = {t[0]: i for i, t in enumerate(vocab)}
    if not isinstance(vocab, dict):
        return None
    return {**vocab, **{t["content"]: t["id"] for t in data.get("added_tokens") or []}}


def _check_tokenizers(target, draft) -> None:
    """Where both are Hugging Face folders, the draft's tokens must have the
    target's ids (a GGUF file's vocabulary is checked by size alone)."""
    if target is None or draft is None or Path(target).resolve() == Path(draft).resolve():
        return
    a, b = _vocab_of(target), _vocab_of(draft)
    if a is None or b is None or a == b:
        return
    diff = next((t for t in sorted(set(a) | set(b), key=lambda t: (a.get(t, -1), t)) if a.get(t) != b.get(t)), None)
    raise ConfigError(f"config key '{KEY}': the draft model's tokenizer differs from the target's (token "
                      f"{diff!r}: id {b.get(diff)} in the draft, {a.get(diff)} in the target); a draft model must "
                      "share the target's tokenizer")


@hookimpl
def fdx_register_proposers(register):
    register("draft_model", DraftModelProposer)
