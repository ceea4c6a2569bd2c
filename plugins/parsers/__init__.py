"""Chat output parsers: tool calls and reasoning (they run in the API process; no Paddle)."""
