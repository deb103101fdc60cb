"""The API key and TLS, one place for both front ends (gRPC and HTTP serve the same key and certificates).

    bearer_matches(value, key)   `Authorization: Bearer <key>`: the scheme in any case (RFC 9110), the
                                 key compared in constant time; gRPC reads it from the call's metadata
                                 (`serving/grpc_edge.py`), HTTP from the header (`serving/http_edge.py`)
    grpc_credentials(config)     the gRPC port's TLS
    uvicorn_tls(config)          the HTTP port's TLS, the same files

With `--tls-client-ca`, both ports require a client certificate that CA signed (mutual TLS).
"""

from __future__ import annotations

import hmac
import ssl
from pathlib import Path
from typing import Any

import grpc

from jaxcpp.config import ServerConfig


def bearer_matches(value: bytes | str, key: str) -> bool:
    """Whether an authorization value is `Bearer <key>` (the scheme in any case, spaces around the key
    ignored)."""
    raw = value.encode() if isinstance(value, str) else value
    scheme, _, token = raw.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


def grpc_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS with the server's chain and key (None: plain TCP)."""
    if not (cfg.tls_cert and cfg.tls_key):
        return None
    pair = (Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())
    if cfg.tls_client_ca is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials([pair], root_certificates=Path(cfg.tls_client_ca).read_bytes(),
                                       require_client_auth=True)


def uvicorn_tls(cfg: ServerConfig) -> dict[str, Any]:
    """`uvicorn.Config`'s TLS arguments (none: plain TCP)."""
    if not cfg.tls_cert:
        return {}
    tls: dict[str, Any] = {"ssl_certfile": cfg.tls_cert, "ssl_keyfile": cfg.tls_key}
    if cfg.tls_client_ca:
        tls |= {"ssl_ca_certs": cfg.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return tls
