"""The `jaxcpp` command: parser wiring, `client` against a fake-engine server, the chunk-plan guard."""

from __future__ import annotations

import re

import pytest

from jaxcpp.serving.cli import build_parser, main
from tests.serving.fakes import expected_tokens, fake_engine


def test_serve_takes_engine_and_server_flags() -> None:
    args = build_parser().parse_args(["serve", "--model", "/m", "--port", "50052", "--pipeline-parallel-size",
                                      "2", "--max-num-batched-tokens", "2048", "--api-key", "k",
                                      "--no-enable-chunked-prefill"])
    from jaxcpp.cli_args import engine_config_from_args, server_config_from_args

    engine, server = engine_config_from_args(args), server_config_from_args(args)
    assert (engine.model.model, engine.parallel.pipeline_parallel_size) == ("/m", 2)
    assert (engine.scheduler.max_num_batched_tokens, engine.scheduler.enable_chunked_prefill) == (2048, False)
    assert (server.port, server.api_key, server.host) == (50052, "k", "127.0.0.1")


def test_generate_seed_is_the_samplers() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "x", "--seed", "7", "--top-k", "5"])
    assert (args.sampling_seed, args.top_k, args.max_tokens) == (7, 5, 64)


def test_bad_server_flag_names_the_flag(capsys) -> None:
    assert main(["serve", "--tls-cert", "c.pem"]) == 2
    assert "--tls-cert" in capsys.readouterr().err


def test_client_command(serve, capsys) -> None:
    server = serve(fake_engine())
    target = ["--target", f"127.0.0.1:{server.port}"]
    assert main(["client", "hello", *target, "--max-tokens", "6", "--stream"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == bytes(expected_tokens(list(b"hello"), 6)).decode()
    assert "generated 6, finish length" in out.err
    assert main(["client", *target, "--prompt-token-ids", "1,2,3", "--max-tokens", "2"]) == 0
    assert main(["client", *target, "--health"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "SERVING"
    assert main(["client", "x", *target, "--top-p", "2"]) == 1
    assert "INVALID_ARGUMENT: top_p:" in capsys.readouterr().err


def test_chunk_plan_is_registered() -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["chunk-plan", "--help"])
    assert exit_.value.code == 0


@pytest.mark.slow
def test_generate_offline_prints_text_and_metrics(capsys) -> None:
    from tests.serving.conftest import MODEL

    argv = ["generate", "--model", MODEL, "--prompt", "def fibonacci(n):", "--max-tokens", "8",
            "--temperature", "0", "--max-model-len", "256", "--max-num-batched-tokens", "64",
            "--max-num-seqs", "8", "--log-stats-interval-s", "0"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert re.search(r"prompt 1[78] tokens, generated \d+", out.err) and "TTFT" in out.err, out.err
    assert main(["generate", "--model", MODEL, "--prompt", "x", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
