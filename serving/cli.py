"""The `jaxcpp` command: `serve`, `client`, `generate` and `chunk-plan`.

    jaxcpp serve --model tiny --port 50051                      # gRPC server (engine + server flags)
    jaxcpp client "def quicksort(" --max-tokens 64 --stream     # talk to it
    jaxcpp generate --model tiny --prompt "def fibonacci(n):"   # offline, no server
    jaxcpp generate --prompt-file long_prompt.txt               # or `--prompt-file -` for stdin
    jaxcpp chunk-plan ...                                       # dynamic chunking plans (jaxcpp.tools.chunk_plan)

Engine flags come from the config dataclasses (`jaxcpp.cli_args`), so they match the Python API, and
every flag's help shows its default. A prompt is text (`--prompt`, or `client`'s positional argument),
a file's exact contents (`--prompt-file PATH`, `-` for stdin) or token ids (`--prompt-token-ids`).
Only `serve` and `generate` import the engine (and so jax); `client` needs only grpc. `generate`
checks everything it can (flags, prompt, tokenizer) before it loads the model and compiles.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from jaxcpp.cli_args import add_config_args, add_engine_args, engine_config_from_args, server_config_from_args
from jaxcpp.config import API_KEY_ENV, ConfigError, ServerConfig
from jaxcpp.core.executor import ExecutorError
from jaxcpp.errors import InvalidRequestError, ModelLoadError
from jaxcpp.logs import configure_cli_logging
from jaxcpp.tools.chunk_plan import add_parser as add_chunk_plan_parser

LOG_LEVELS = ("debug", "info", "warning", "error")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    group.add_argument("--temperature", type=float, default=None,
                       help="0 = greedy (default: the engine's, 1.0)")
    group.add_argument("--top-k", type=int, default=None,
                       help="keep the k most likely tokens (default: the engine's, 0 = off)")
    group.add_argument("--top-p", type=float, default=None,
                       help="nucleus mass in (0, 1] (default: the engine's, 1.0 = off)")
    group.add_argument("--seed", dest="sampling_seed", metavar="SEED", type=int, default=None,
                       help="seed of this request's sampler (default: drawn from the engine's --seed)")
    group.add_argument("--stop-token-ids", type=_int_list, default=(),
                       help="comma-separated stop ids (default: none)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS (default: off)")


def _add_prompt_args(parser: argparse.ArgumentParser, text_flag: bool) -> None:
    """--prompt (generate; client takes it positionally), --prompt-file and --prompt-token-ids: one of them."""
    group = parser.add_mutually_exclusive_group()
    which = (" (one of --prompt, --prompt-file, --prompt-token-ids is required)" if text_flag
             else " (default: none; or give the prompt text as the positional argument)")
    if text_flag:
        group.add_argument("--prompt", default=None, help="prompt text" + which)
    group.add_argument("--prompt-file", metavar="PATH", default=None,
                       help="read the prompt from this file, exactly as it is (UTF-8); '-' reads stdin" + which)
    group.add_argument("--prompt-token-ids", type=_int_list, default=None,
                       help="prompt as comma-separated token ids (for models without a tokenizer)" + which)


def _read_prompt(args: argparse.Namespace) -> str | list[int] | None:
    """The prompt from whichever of text, file, stdin or token ids was given; None when none was."""
    if args.prompt_token_ids is not None:
        return args.prompt_token_ids
    if args.prompt_file is None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidRequestError("--prompt-file", f"cannot read {args.prompt_file}: {err}") from None


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.sampling_seed, stop_token_ids=tuple(args.stop_token_ids),
                  ignore_eos=args.ignore_eos)
    return {k: v for k, v in kwargs.items() if v is not None}


def _metrics_line(num_prompt: int, num_generated: int, finish: str | None, ttft_s: float,
                  e2e_s: float) -> str:
    tpot = (e2e_s - ttft_s) / (num_generated - 1) if num_generated > 1 else 0.0
    rate = num_generated / e2e_s if e2e_s > 0 else 0.0
    return (f"[prompt {num_prompt} tokens, generated {num_generated}, finish {finish}, "
            f"TTFT {ttft_s * 1e3:.1f} ms, TPOT {tpot * 1e3:.1f} ms, e2e {e2e_s:.2f} s, {rate:.1f} tok/s]")


# -- serve ---------------------------------------------------------------------------------------
def command_line_key_warning(args: argparse.Namespace) -> str | None:
    if getattr(args, "api_key", None) is None:
        return None
    return ("jaxcpp serve: warning: --api-key on the command line is visible to every user in `ps`; "
            "use --api-key-file or the JAXCPP_API_KEY environment variable")


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from jaxcpp.serving.lifecycle import Server, serve
    from jaxcpp.serving.security import check_files

    configure_cli_logging(args.log_level)
    server_config = server_config_from_args(args)
    check_files(server_config)  # before anything starts, on every host of a pipeline
    engine_config = engine_config_from_args(args)
    if engine_config.parallel.is_multi_host:
        from jaxcpp.pipe.cluster import shared_control_key

        shared_control_key()  # before anything starts: refused without a shared key (ConfigError)
        if engine_config.parallel.process_id:  # a stage worker
            return _serve_stage(engine_config.parallel)
    if (warning := command_line_key_warning(args)) is not None:
        print(warning, file=sys.stderr, flush=True)
    from jaxcpp.models.spec import resolve_model_spec

    resolve_model_spec(engine_config.model.model, engine_config.model.dtype)  # a bad folder fails before listening

    def build_engine() -> Any:  # in a worker thread, while health answers NOT_SERVING
        from jaxcpp.core.engine import LLMEngine

        return LLMEngine(engine_config)

    served = False
    started: list[Server] = []

    def listening(server: Server) -> None:
        started.append(server)
        print(f"jaxcpp: listening on {_addresses(server)} (health NOT_SERVING); loading "
              f"{engine_config.model.model} and compiling every bucket ...", file=sys.stderr, flush=True)

    def ready(server: Server) -> None:
        nonlocal served
        served = True
        metrics = f", metrics on http://{server_config.host}:{server.metrics_port}/metrics" \
            if server.metrics_port is not None else ""
        tls = " (TLS)" if server_config.tls_cert else ""
        print(f"jaxcpp: serving {engine_config.model.model} on {_addresses(server)}{tls}{metrics}", flush=True)

    code = asyncio.run(serve(build_engine, server_config, on_ready=ready, on_listening=listening))
    print(closing_line(started[0].metrics.finished_counts() if started else {}, code), file=sys.stderr, flush=True)
    if code != 0 or not served:  # the engine failed, or a stop during warm-up
        _exit_now(code)
    return code


def closing_line(finished: dict[str, int], code: int) -> str:
    """The server's last line, so that a clean exit can be told from a kill: requests by how they ended."""
    done = sum(n for reason, n in finished.items() if reason not in ("abort", "error"))
    return (f"jaxcpp: stopped: {done} requests finished, {finished.get('abort', 0)} aborted, "
            f"{finished.get('error', 0)} failed, exit {code}")


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown. After a failure (a stage's death) the server and the stages
    are stopped and teardown would take about a second more, while the contract is to be gone within 2 s.
    A stop during warm-up leaves the engine's build running in threads (loading weights, an XLA compile
    that cannot be interrupted) that interpreter exit would wait for, up to a minute on a real model:
    past an orchestrator's grace period. Nothing is in flight either way, so nothing is lost."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _addresses(server: Any) -> str:
    """`host:port` (gRPC) and `http://host:port/v1` (the OpenAI API), whichever are on."""
    host = server.config.host
    where = [f"{host}:{server.port} (gRPC)"] if server.config.enable_grpc else []
    if server.http_port is not None:
        scheme = "https" if server.config.tls_cert else "http"
        where.append(f"{scheme}://{host}:{server.http_port}/v1 (OpenAI API)")
    return " and ".join(where)


def _serve_stage(parallel: Any) -> int:
    """Host I > 0 of a multi-host pipeline: run stage I for the head (process 0), which owns the
    engine and the gRPC server and sends this process its config; exits when the head stops it."""
    from jaxcpp.pipe.cluster import Addresses
    from jaxcpp.runtime.stage_process import serve_stage

    addresses = Addresses.of(parallel)
    print(f"jaxcpp: process {parallel.process_id} of {parallel.num_processes} runs stage {parallel.process_id} "
          f"for the head at {addresses.control}, advertising {addresses.advertise}", file=sys.stderr, flush=True)
    return serve_stage(addresses.control, parallel.process_id, addresses.advertise)


# -- client --------------------------------------------------------------------------------------
def _client(args: argparse.Namespace) -> int:
    from jaxcpp.serving.client import Client, ClientError
    from jaxcpp.serving.security import resolve_api_key

    if args.prompt is not None and (args.prompt_file is not None or args.prompt_token_ids is not None):
        print("jaxcpp client: give the prompt once: as text, --prompt-file or --prompt-token-ids", file=sys.stderr)
        return 2
    prompt = _read_prompt(args)
    api_key = resolve_api_key(ServerConfig(api_key=args.api_key, api_key_file=args.api_key_file))
    with Client(args.target, api_key=api_key, tls=args.tls, root_certificates=args.tls_ca,
                server_name=args.server_name, timeout=args.timeout) as client:
        try:
            try:
                return _client_call(client, args, prompt)
            except ClientError as err:
                if err.status.name != "UNAVAILABLE":
                    raise
                _wait_for_connection(client, args.timeout, err)
                return _client_call(client, args, prompt)  # the server came up within --timeout: once more
        except ClientError as err:
            print(f"jaxcpp client: {_explain(err)}", file=sys.stderr)
            return 1


CONNECT_WAIT_S = 1.0  # how long a client without --timeout waits for a server it cannot reach


def _wait_for_connection(client: Any, timeout: float | None, err: Any) -> None:
    """Wait for the connection as long as --timeout says (CONNECT_WAIT_S without it); if it never comes,
    ClientError with `wait_connected`'s sentence first, the call's transport text (the cause: refused,
    DNS, a TLS handshake) after it."""
    from jaxcpp.serving.client import ClientError

    try:
        client.wait_connected(timeout=timeout or CONNECT_WAIT_S)
    except ClientError as unreachable:
        raise ClientError(unreachable.status, f"{unreachable.message} ({err.message})") from None


def _explain(err: Any) -> str:
    """The failure in words that say what to do: a refused key names where the key comes from."""
    if err.status.name == "UNAUTHENTICATED":
        return (f"{err.status.name}: {err.message}; give the server's key with --api-key-file PATH or the "
                f"{API_KEY_ENV} environment variable")
    return f"{err.status.name}: {err.message}"


def _client_call(client: Any, args: argparse.Namespace, prompt: str | list[int] | None) -> int:
    if args.health:
        print(client.health())
        return 0
    if args.model_info:
        print(client.model_info())
        return 0
    if args.stats:
        print(client.stats())
        return 0
    if prompt is None:
        print("jaxcpp client: give a prompt (or --prompt-file, --prompt-token-ids, --health, --model-info, "
              "--stats)", file=sys.stderr)
        return 2
    if args.stream:
        last = None
        for delta in client.stream(prompt, **_sampling_kwargs(args)):
            print(delta.text, end="", flush=True)
            last = delta
        print()
        assert last is not None
        out: Any = last
    else:
        out = client.generate(prompt, **_sampling_kwargs(args))
        print(out.text)
    line = _metrics_line(out.num_prompt_tokens, out.num_generated_tokens, out.finish_reason, out.ttft_s,
                         out.e2e_s)
    print(line, file=sys.stderr)
    return 0


# -- generate (offline) --------------------------------------------------------------------------
def _generate(args: argparse.Namespace) -> int:
    """Everything that can be checked is, before minutes of loading and compiling: the flags, the
    prompt, the model folder (config.json, tokenizer), the prompt against the model's length."""
    configure_cli_logging(args.log_level)
    config = engine_config_from_args(args)  # validates; errors name the flag
    prompt = _read_prompt(args)
    if prompt is None:
        raise InvalidRequestError("--prompt", "give a prompt: --prompt TEXT, --prompt-file PATH (or -), "
                                  "or --prompt-token-ids 1,2,3")
    from jaxcpp import LLM, SamplingParams
    from jaxcpp.core.engine import check_request
    from jaxcpp.core.sizing import EngineSizing
    from jaxcpp.models.spec import resolve_model_spec

    params = SamplingParams(**_sampling_kwargs(args))
    sizing = EngineSizing.plan(config, resolve_model_spec(config.model.model, config.model.dtype))
    token_ids = prompt if isinstance(prompt, list) else _encode(sizing.spec, prompt)
    check_request(token_ids, params, sizing, config.scheduler)
    with LLM.from_config(config) as llm:
        out = llm.generate(prompt_token_ids=[token_ids], sampling_params=params)[0]
        text = out.text if llm.engine.tokenizer is not None else ",".join(map(str, out.token_ids))
    m = out.metrics
    print(text)
    print(_metrics_line(len(out.prompt_token_ids), len(out.token_ids), out.finish_reason, m.ttft or 0.0,
                        m.e2e or 0.0), file=sys.stderr)
    return 0


def _encode(spec: Any, text: str) -> list[int]:
    if spec.tokenizer is None:
        raise InvalidRequestError("--prompt", f"{spec.name} has no tokenizer (tokenizer.json or "
                                  "byte_tokenizer.json): give --prompt-token-ids instead")
    return list(spec.tokenizer.encode(text))


# -- parser --------------------------------------------------------------------------------------
def _add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="the project's log level; JAX, absl and orbax log below WARNING only at debug "
                             "(default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxcpp",
                                     description="JAX/XLA LLM inference engine and gRPC server")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the gRPC server", description="Run the gRPC server.")
    add_engine_args(serve)
    add_config_args(serve, ServerConfig)
    _add_log_level(serve)
    serve.set_defaults(func=_serve)

    client = sub.add_parser("client", help="send a request to a server", description="Call a jaxcpp server.")
    client.add_argument("prompt", nargs="?", help="prompt text")
    _add_prompt_args(client, text_flag=False)
    client.add_argument("--target", default="127.0.0.1:50051",
                        help="server address host:port (default: %(default)s)")
    client.add_argument("--stream", action="store_true", help="print tokens as they arrive (default: off)")
    key = client.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="sent as 'authorization: Bearer <key>'; visible in `ps` (default: --api-key-file, "
                          f"else env {API_KEY_ENV})")
    key.add_argument("--api-key-file", metavar="PATH", default=None,
                     help=f"read the key from this file's first line (default: env {API_KEY_ENV})")
    client.add_argument("--tls", action="store_true",
                        help="use TLS with the system's root certificates (default: off)")
    client.add_argument("--tls-ca", default=None,
                        help="PEM root certificate(s) to trust (implies --tls; default: none)")
    client.add_argument("--server-name", default=None,
                        help="TLS name to verify instead of the target's host (default: none)")
    client.add_argument("--timeout", type=float, default=None, help="deadline in seconds, and how long to wait "
                        "for a server that cannot be reached yet (default: no deadline, a 1 s wait)")
    what = client.add_mutually_exclusive_group()
    what.add_argument("--health", action="store_true", help="print the health status")
    what.add_argument("--model-info", action="store_true", help="print the model info")
    what.add_argument("--stats", action="store_true", help="print the server stats")
    _add_sampling_args(client)
    client.set_defaults(func=_client)

    # `--seed` here is the sampler's; the engine's --seed (random-model init) is replaced (resolve).
    generate = sub.add_parser("generate", help="generate offline (no server)", conflict_handler="resolve",
                              description="Generate offline with jaxcpp.LLM.")
    _add_prompt_args(generate, text_flag=True)
    add_engine_args(generate)
    _add_sampling_args(generate)
    _add_log_level(generate)
    generate.set_defaults(func=_generate)

    add_chunk_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, ModelLoadError, InvalidRequestError) as err:
        print(f"jaxcpp {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (ExecutorError, ConnectionError) as err:  # a stage failed to start, or found no head: one line
        print(f"jaxcpp {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
