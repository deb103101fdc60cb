"""Errors a caller can act on. Each names the offending field so a client can fix its request."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses; nothing was admitted and nothing leaked."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ModelLoadError(ValueError):
    """A model folder or checkpoint that cannot be loaded; the message names the file."""
