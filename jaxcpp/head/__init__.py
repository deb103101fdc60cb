"""The head's side of the process boundary: the multi-process executor, its wire protocol, how the
processes find each other, and the trace (no jax: the head of a multi-process pipeline holds no device)."""
