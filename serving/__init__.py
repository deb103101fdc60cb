"""gRPC serving: proto, server, client stubs and the `jaxcpp` CLI. Never imports jax directly.

`Client`, `AsyncClient` and `ClientError` (what every failed client call raises) load lazily.
"""

from typing import TYPE_CHECKING, Any

__all__ = ["Client", "AsyncClient", "ClientError"]

if TYPE_CHECKING:
    from jaxcpp.serving.client import AsyncClient, Client, ClientError


def __getattr__(name: str) -> Any:
    # Lazy: `import jaxcpp.serving` stays light; grpc loads on first use of a client.
    if name in __all__:
        from jaxcpp.serving import client

        return getattr(client, name)
    raise AttributeError(f"module 'jaxcpp.serving' has no attribute {name!r}")
