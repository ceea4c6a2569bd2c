"""Observers (``fdx_register_observers``): the built-in ``otel``."""
