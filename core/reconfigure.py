"""What ``EngineCore.reconfigure`` may change over a loaded model and its KV
tensors, and the merged config it builds from (docs/research.md)."""
from __future__ import annotations

from typing import Any

from fdx.core.config import ConfigError, FdxConfig

# the scheduler side, the KV cache plugin over the same tensors, the connector, the logits
# processors and the sampler's seed; plugin settings of those kinds
RECONFIGURABLE = ("scheduler.", "cache.kv_cache", "cache.num_kv_blocks", "cache.kv_connector",
                  "decoding.logits_processors", "seed", *(f"plugins.{k}." for k in (
                      "kv_scheduler", "queue_policy", "admission_rule", "preemption_policy", "kv_cache",
                      "connector", "logits_processor")))
# the runner side of these (logits processors, sampler seed, connector) is rebuilt by the executor on
# every rank (Executor.reconfigure), which refuses what it cannot run (a connector under tensor parallel)


def reconfigured(current: FdxConfig, config: FdxConfig | None, changes: dict[str, Any], *,
                 kv_blocks: int) -> FdxConfig:
    """``current`` with ``config``'s explicitly set keys, then ``changes``
    (config keys, flat or dotted), over it; a ConfigError naming the first
    key that would need a reload, nothing changed."""
    new = current
    for top in ([config] if config is not None else []) + ([FdxConfig.build(**changes)] if changes else []):
        new = new.overlay(top)
    old_keys, new_keys = current.dotted(), new.dotted()
    for key in sorted(set(old_keys) | set(new_keys)):
        if old_keys.get(key) == new_keys.get(key):
            continue
        if not key.startswith(RECONFIGURABLE) or key == "scheduler.request_scheduler":
            raise ConfigError(f"config key '{key}': reconfigure keeps the model and its KV tensors; "
                              f"changing {key} needs a new engine (a new LLM)")
    if new.cache.num_kv_blocks > kv_blocks:
        raise ConfigError(f"config key 'cache.num_kv_blocks': {new.cache.num_kv_blocks} exceeds the "
                          f"{kv_blocks} blocks the KV tensors hold")
    return new
