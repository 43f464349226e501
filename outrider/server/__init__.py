"""`outrider serve`: OpenAI- and Anthropic-compatible HTTP API over one engine worker."""
