"""The OpenAI-compatible server: app, protocol, rendering, engine process and client."""
