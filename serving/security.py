"""The API key and TLS, one place for both front ends (gRPC and HTTP serve the same key and certificates).

    bearer_matches(value, key)   `Authorization: Bearer <key>`: the scheme in any case (RFC 9110), the
                                 key compared in constant time; gRPC reads it from the call's metadata
                                 (`serving/grpc_edge.py`), HTTP from the header (`serving/http_edge.py`)
    grpc_credentials(config)     the gRPC port's TLS
    uvicorn_tls(config)          the HTTP port's TLS, the same files
    check_files(config)          every file flag (TLS, --api-key-file) names a file: ConfigError naming the
                                 flag, at start-up, before the model loads
    resolve_api_key(config)      the key to require: --api-key, else --api-key-file's first line, else env
                                 JAXCPP_API_KEY; read once, at start-up (`serving/lifecycle.py`)

With `--tls-client-ca`, both ports require a client certificate that CA signed (mutual TLS).
"""

from __future__ import annotations

import hmac
import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

from jaxcpp.config import API_KEY_ENV, ServerConfig, require

FILE_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "api_key_file")


def check_files(cfg: ServerConfig) -> None:
    """ConfigError naming the flag for a file flag whose file is not there."""
    for name in FILE_FLAGS:
        path = getattr(cfg, name)
        require(path is None or os.path.isfile(path), name, f"no such file: {path!r}")


def resolve_api_key(cfg: ServerConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key to require (or, for `jaxcpp client`, to send): --api-key, else the first line of
    --api-key-file, else env JAXCPP_API_KEY; None: no key."""
    if cfg.api_key is not None:
        return cfg.api_key
    if cfg.api_key_file is not None:
        require(os.path.isfile(cfg.api_key_file), "api_key_file", f"no such file: {cfg.api_key_file!r}")
        with open(cfg.api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
        require(bool(key), "api_key_file", f"{cfg.api_key_file} is empty")
        return key
    return environ.get(API_KEY_ENV) or None


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
