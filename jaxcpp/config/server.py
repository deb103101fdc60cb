"""The server around the engine: both front ends, their limits, TLS and the API key (`ServerConfig`).

Values only: that the TLS and key files exist, and what the key is (`--api-key-file`, env JAXCPP_API_KEY),
are read at start-up by their owner, `serving/security.py`."""

from __future__ import annotations

from dataclasses import dataclass

from jaxcpp.config.fields import opt, require

API_KEY_ENV = "JAXCPP_API_KEY"  # read at start-up by serving/security.py, and by the client


@dataclass(frozen=True)
class ServerConfig:
    host: str = opt("127.0.0.1", "address to bind (both APIs); the default is loopback only")
    port: int = opt(50051, "gRPC port (0: pick a free one)")
    http_port: int = opt(8000, "OpenAI-compatible HTTP API port (0: pick a free one)")
    enable_grpc: bool = opt(True, "serve the gRPC API on --port (--no-enable-grpc: HTTP only)")
    enable_http: bool = opt(True, "serve the OpenAI-compatible HTTP API on --http-port (--no-enable-http: gRPC "
                            "only)")
    served_model_name: str | None = opt(None, "model name(s) the HTTP API answers to, comma-separated "
                                        "(default: --model as given)")
    chat_template: str | None = opt(None, "jinja2 chat template for /v1/chat/completions: a file, or the "
                                    "template itself (default: the model's tokenizer_config.json)")
    enable_auto_tool_choice: bool = opt(False, 'let chat requests use tool_choice "auto" (the model decides; '
                                        "calls parsed from its text by --tool-call-parser)")
    tool_call_parser: str | None = opt(None, "how tool calls are parsed from generated text for tool_choice "
                                       '"auto": hermes (<tool_call>{"name": ..., "arguments": ...}</tool_call>)')
    metrics_port: int | None = opt(None, "serve Prometheus metrics on this port (the HTTP API serves them "
                                   "at /metrics too)")
    max_queue_size: int = opt(256, "calls waiting or running, both APIs together, before RESOURCE_EXHAUSTED "
                              "(gRPC) or 429 (HTTP)")
    max_message_bytes: int = opt(4 * 1024 * 1024, "largest gRPC message accepted or sent, and largest HTTP "
                                 "request body (413 beyond)")
    max_prompt_bytes: int = opt(1024 * 1024, "largest text prompt, in UTF-8 bytes, checked before "
                                "tokenizing (INVALID_ARGUMENT, or HTTP 413, beyond)")
    max_stream_buffer: int = opt(256, "responses a call may hold for a client that is not reading, per sample "
                                 "of each prompt (n x prompts); past it the call is aborted with "
                                 "RESOURCE_EXHAUSTED (HTTP: an error event)")
    max_header_bytes: int = opt(64 * 1024, "largest HTTP request head (request line and headers), counted as "
                                "it arrives: 431 and the connection closed beyond")
    http_read_timeout_s: float = opt(30.0, "seconds an HTTP client may take to send a request's headers "
                                     "(connection closed past it), and then its body (408)")
    tls_cert: str | None = opt(None, "PEM certificate chain for TLS")
    tls_key: str | None = opt(None, "PEM private key for TLS")
    tls_client_ca: str | None = opt(None, "PEM CA certificate(s): require a client certificate signed "
                                    "by one of them (mutual TLS; needs --tls-cert)")
    api_key: str | None = opt(None, "require this key in the 'authorization: Bearer <key>' metadata "
                              f"(visible in `ps`: prefer --api-key-file or env {API_KEY_ENV})")
    api_key_file: str | None = opt(None, "read the API key from this file (its first line)")
    enable_reflection: bool = opt(True, "offer gRPC server reflection (grpcurl list/describe)")
    shutdown_grace_s: float = opt(30.0, "seconds in-flight requests may finish after SIGTERM")

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "port", f"must be in [0, 65535], got {self.port}")
        require(0 <= self.http_port <= 65535, "http_port", f"must be in [0, 65535], got {self.http_port}")
        require(self.enable_grpc or self.enable_http, "enable_http", "--no-enable-grpc and --no-enable-http "
                "leave nothing to serve")
        require(self.max_queue_size >= 1, "max_queue_size", "must be >= 1")
        require(self.max_message_bytes >= 1024, "max_message_bytes", "must be >= 1024")
        require(self.max_prompt_bytes >= 1, "max_prompt_bytes", "must be >= 1")
        require(self.max_stream_buffer >= 1, "max_stream_buffer", "must be >= 1")
        require(self.max_header_bytes >= 1024, "max_header_bytes", "must be >= 1024")
        require(self.http_read_timeout_s > 0, "http_read_timeout_s", "must be > 0")
        require(self.shutdown_grace_s >= 0, "shutdown_grace_s", "must be >= 0")
        require(self.tool_call_parser in (None, "hermes"), "tool_call_parser",
                f"must be hermes, got {self.tool_call_parser!r}")
        require(not self.enable_auto_tool_choice or self.tool_call_parser is not None, "enable_auto_tool_choice",
                "needs --tool-call-parser")
        require((self.tls_cert is None) == (self.tls_key is None), "tls_cert",
                "--tls-cert and --tls-key must be given together")
        require(self.tls_client_ca is None or self.tls_cert is not None, "tls_client_ca",
                "mutual TLS needs the server's own --tls-cert and --tls-key")
        require(self.api_key is None or self.api_key_file is None, "api_key_file",
                "give --api-key or --api-key-file, not both")
        require(self.api_key is None or self.api_key != "", "api_key", "must not be empty")
