"""`dflash-jax serve`: an OpenAI-compatible HTTP server over the Engine (the `serve` extra)."""
