"""``example-lookback``: a speculative-decoding proposer written from
docs/plugins.md alone. It remembers where each token last occurred in the
request and proposes the tokens that followed that occurrence (a one-token
lookup), up to ``max_draft`` of them (its setting) and k."""
from __future__ import annotations

from dataclasses import dataclass

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Proposer

EVENTS: list[tuple[str, str, int]] = []    # (event, request id, number): what the engine told it, for tests


@dataclass
class LookbackSettings:
    max_draft: int = 8


class LookbackProposer(Proposer):
    Settings = LookbackSettings

    def __init__(self, settings, context):
        super().__init__(settings, context)

    def add_request(self, request_id, prompt_token_ids):
        EVENTS.append(("add", request_id, len(prompt_token_ids)))

    def propose(self, request_id, token_ids, k, hidden_states=None):
        last = token_ids[-1]
        for i in range(len(token_ids) - 2, -1, -1):
            if token_ids[i] == last:
                return list(token_ids[i + 1:i + 1 + min(k, self.settings.max_draft)])
        return []

    def on_accepted(self, request_id, num_proposed, num_accepted):
        EVENTS.append(("accepted", request_id, num_accepted))

    def on_preempted(self, request_id):
        EVENTS.append(("preempted", request_id, 0))

    def remove_request(self, request_id, output_token_ids):
        EVENTS.append(("remove", request_id, len(output_token_ids)))


@hookimpl
def fdx_register_proposers(register):
    register("example-lookback", LookbackProposer)
