"""An outside mixture-of-experts router, written from docs/plugins.md's
router contract alone: ``example-uniform`` chooses each row's top-k experts
by router logit, as the architectures do, but weights them equally (1/k),
ignoring the probabilities: the kind of change a load-balancing study
makes. It imports numpy and fdx.core.hookspecs only."""
from __future__ import annotations

import numpy as np

from fdx.core.hookspecs import hookimpl


class UniformTopK:
    def __init__(self, settings: dict, context):
        moe_config = context.moe
        self.top_k = int(settings.get("top_k", moe_config.top_k))
        if not 1 <= self.top_k <= moe_config.num_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and {moe_config.num_experts}")

    def __call__(self, logits: np.ndarray, bias: np.ndarray | None):
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :self.top_k].astype(np.int64)
        return ids, np.full(ids.shape, 1.0 / self.top_k, dtype=np.float32)


@hookimpl
def fdx_register_moe_routers(register):
    register("example-uniform", UniformTopK)
