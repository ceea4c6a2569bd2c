"""Request-level schedulers (``scheduler.request_scheduler``, registered by
``fdx_register_schedulers``): where a server's requests run.

``local`` (the default): in this server's own engine. Any other name wraps
the server's ``EngineClient`` in the registered class, which must keep the
client's interface as the server uses it:

- ``await start() -> EngineReady`` (start the local engine first),
- ``add(request_id, prompt_token_ids, params, callback, trace=None)``: the
  callback gets ``SeqDelta``s (only new tokens, in order), an
  ``EngineRejected``, or an ``EngineDeadError`` when the request cannot be
  served; ``trace`` (a dict: ``x-request-id``, W3C ``traceparent`` /
  ``tracestate``) goes to the engine that runs it, as ``add``'s own,
- ``abort(request_ids)``, ``finished(request_id)``, ``await shutdown()``,
  and every other attribute (``dead``, ``pid``, ``ready``) of the client.

Constructed as ``cls(config, engine_client, metrics, settings)``, with
``settings`` from ``plugins: {scheduler: {<name>: {...}}}``.
"""
from __future__ import annotations


def wrap_engine(config, engine, metrics, plugins):
    """``engine`` as the configured request scheduler wraps it (``plugins``:
    the API process's plugin manager)."""
    from fdx.core.config import ConfigError
    from fdx.core.plugins import PluginError
    name = config.scheduler.request_scheduler
    try:
        cls = plugins.get("scheduler", name)
    except PluginError as e:
        raise ConfigError(f"config key 'scheduler.request_scheduler': {e}") from None
    if getattr(cls, "local", False):
        return engine
    settings = dict(config.plugins.get("scheduler", {}).get(name, {}) or {})
    try:
        return cls(config, engine, metrics, settings)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config key 'plugins.scheduler.{name}': {e}") from None
