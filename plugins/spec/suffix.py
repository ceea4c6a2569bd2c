"""The ``suffix`` proposer: suffix decoding (Arctic Inference's, as vLLM and
FastDeploy ship it). Each request keeps a suffix trie of depth
``suffix_decoding_max_tree_depth`` over its prompt and output, with a count
on every node (how often that token string occurred); a second trie holds
the outputs of the last ``suffix_decoding_max_cached_requests`` finished
requests. To draft, the longest suffix of the request's tokens that
occurred before with a continuation is found in each trie, and the most
frequent continuation is followed while its share of the branches, times
the shares before it, stays at or above ``suffix_decoding_min_token_prob``,
for at most ``suffix_decoding_max_spec_factor`` x the match length tokens
(and k); the draft with the larger expected accepted length wins."""
from __future__ import annotations

import math
from collections import deque
from typing import Sequence

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Proposer


class _Node:
    __slots__ = ("children", "count")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTrie:
    """Every substring of the inserted sequences up to ``depth`` tokens, with
    occurrence counts. ``extend`` adds one token to an open sequence (its
    open suffixes step down one level); ``add``/``remove`` a whole one."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()

    def open(self) -> list[_Node]:
        return []

    def extend(self, active: list[_Node], token: int, delta: int = 1) -> list[_Node]:
        """``active``: the nodes of the open sequence's suffixes (shortest
        first, below the depth); returns them after ``token``."""
        out = []
        for node in [self.root, *active]:
            child = node.children.get(token)
            if child is None:
                if delta < 0:
                    continue
                child = node.children[token] = _Node()
            child.count += delta
            if child.count <= 0:
                del node.children[token]
                continue
            if len(out) + 1 < self.depth:
                out.append(child)
        return out

    def add(self, tokens: Sequence[int], delta: int = 1) -> None:
        active: list[_Node] = []
        for t in tokens:
            active = self.extend(active, int(t), delta)

    def draft(self, tokens: Sequence[int], k: int, factor: float, min_prob: float,
              active: list[_Node] | None = None) -> tuple[list[int], float, int]:
        """(draft, score: the sum of its tokens' probabilities, the length of
        the suffix matched) after the longest suffix of ``tokens`` that has a
        continuation here."""
        if active is None:                      # walk each suffix from the root (the shared trie)
            candidates = []
            for m in range(min(self.depth - 1, len(tokens)), 0, -1):
                node = self.root
                for t in tokens[len(tokens) - m:]:
                    node = node.children.get(int(t))
                    if node is None:
                        break
                if node is not None and node.children:
                    candidates.append((m, node))
                    break
        else:                                   # active[i]: the suffix of length i + 1
            candidates = [(m + 1, n) for m, n in reversed(list(enumerate(active))) if n.children][:1]
        if not candidates:
            return [], 0.0, 0
        m, node = candidates[0]
        limit = min(k, max(1, math.floor(factor * m)))
        out, prob, score = [], 1.0, 0.0
        while node.children and len(out) < limit:
            total = sum(c.count for c in node.children.values())
            token, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
            prob *= child.count / total
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            node = child
        return out, score, m


class SuffixProposer(Proposer):
    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        config = self.config
        sc = config.speculative
        self.depth = sc.suffix_decoding_max_tree_depth
        self.factor, self.min_prob = sc.suffix_decoding_max_spec_factor, sc.suffix_decoding_min_token_prob
        self.max_cached = sc.suffix_decoding_max_cached_requests
        self.shared = SuffixTrie(self.depth)
        self.cached: deque[list[int]] = deque()
        self.requests: dict[str, tuple[SuffixTrie, list, int]] = {}   # id -> (trie, active nodes, tokens in it)
        self.match: dict[str, tuple[int, bool]] = {}    # id -> the last draft's (match length, unambiguous)

    def add_request(self, request_id, prompt_token_ids):
        self.requests[request_id] = (SuffixTrie(self.depth), [], 0)

    def propose(self, request_id, token_ids, k, hidden_states=None):
        if request_id not in self.requests:
            self.add_request(request_id, token_ids)
        trie, active, seen = self.requests[request_id]
        for t in token_ids[seen:]:
            active = trie.extend(active, int(t))
        self.requests[request_id] = (trie, active, len(token_ids))
        # the current end occurred once (just now): a node with children has occurred before
        own, own_score, m = trie.draft(token_ids, k, self.factor, self.min_prob, active)
        if self.cached:
            other, other_score, other_m = self.shared.draft(token_ids, k, self.factor, self.min_prob)
            if other_score > own_score:
                own, own_score, m = other, other_score, other_m
        # unambiguous: every token was (nearly) the only continuation seen (the sum of the cumulative
        # probabilities at least 0.9 x the length)
        self.match[request_id] = (m, bool(own) and own_score >= 0.9 * len(own))
        return own

    def draft_class(self, request_id):
        """The class of the last draft (core/spec.py's DraftRecord keeps
        acceptance per class, and cuts each draft to the length its class
        pays for): the strength of its match, as suffix decoding scores a
        candidate by match length and frequency. The length of the suffix it
        matched, 1, 2, 3-4, 5-7 or 8 and more (a one-token match is kept far
        less often), and whether every token of it was unambiguous (+5: its
        share of the branches after the match, times the ones before it,
        stayed near 1)."""
        m, sure = self.match.get(request_id, (0, False))
        return (0 if m <= 1 else 1 if m == 2 else 2 if m <= 4 else 3 if m <= 7 else 4) + (5 if sure else 0)

    def forget_history(self):
        """Drop the finished requests' outputs (``fdx bench`` between rounds)."""
        self.shared = SuffixTrie(self.depth)
        self.cached.clear()

    def remove_request(self, request_id, output_token_ids):
        self.requests.pop(request_id, None)
        self.match.pop(request_id, None)
        if self.max_cached <= 0 or not output_token_ids:
            return
        out = [int(t) for t in output_token_ids]
        self.shared.add(out)
        self.cached.append(out)
        while len(self.cached) > self.max_cached:
            self.shared.add(self.cached.popleft(), delta=-1)


@hookimpl
def fdx_register_proposers(register):
    register("suffix", SuffixProposer)
