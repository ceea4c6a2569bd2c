"""Request-level schedulers (``scheduler.request_scheduler``, registered by
``fdx_register_request_schedulers``): where a server's requests run.

``local`` (the default): in this server's own engine. Any other name wraps
the server's ``EngineClient`` in the registered class, a
``fdx.core.interfaces.RequestScheduler`` (its contract is written there).
"""
from __future__ import annotations


def wrap_engine(config, engine, metrics, plugins):
    """``engine`` as the configured request scheduler wraps it (``plugins``:
    the API process's plugin manager)."""
    from fdx.core.plugins import make_plugin
    from fdx.core.config import ConfigError
    from fdx.core.interfaces import BuildContext, RequestScheduler
    from fdx.core.plugins import PluginError
    name = config.scheduler.request_scheduler
    try:
        cls = plugins.get("request_scheduler", name)
    except PluginError as e:
        raise ConfigError(f"config key 'scheduler.request_scheduler': {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, RequestScheduler)):
        raise ConfigError(f"config key 'scheduler.request_scheduler': {name!r} is not a request scheduler "
                          "(fdx.core.interfaces.RequestScheduler)")
    if not cls.wraps:
        return engine
    return make_plugin(BuildContext(config, plugins, "request_scheduler", name, engine=engine, metrics=metrics),
                       "scheduler.request_scheduler", cls=cls)
