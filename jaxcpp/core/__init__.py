"""The host core: requests, pages, the scheduler, the engine loop and the executor contract (no jax)."""
