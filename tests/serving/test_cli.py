"""The `jaxcpp` command: parser wiring, `client` against a fake-engine server, the chunk-plan guard,
every default in `--help`, prompts from files and stdin, and `generate`'s checks before it compiles."""

from __future__ import annotations

import argparse
import io
import re
from pathlib import Path

import pytest

from jaxcpp.config import ENGINE_SECTIONS, ServerConfig
from jaxcpp.serving.cli import build_parser, main
from tests.serving.fakes import expected_tokens, fake_engine


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


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


@pytest.mark.parametrize("command", ["serve", "generate", "client", "chunk-plan"])
def test_help_shows_every_default(command: str) -> None:
    """serve: every flag; the others: every flag that takes a value (on/off switches say what they do)."""
    def states_default(action: argparse.Action) -> bool:
        return any(word in (action.help or "") for word in ("(default", "default: ", "required"))

    switches = (argparse._StoreTrueAction, argparse._HelpAction)
    missing = [action.option_strings[0] for action in subcommand(command)._actions
               if action.option_strings and action.help != argparse.SUPPRESS  # hidden: deprecated aliases
               and not isinstance(action, argparse._HelpAction)
               and (command == "serve" or not isinstance(action, switches)) and not states_default(action)]
    assert missing == [], f"{command} --help gives no default for {missing}"


def test_config_flag_help_states_the_dataclass_default() -> None:
    helps = {a.dest: a.help for a in subcommand("serve")._actions}
    import dataclasses

    for cls in (*ENGINE_SECTIONS.values(), ServerConfig):
        for fld in dataclasses.fields(cls):
            if fld.default is not dataclasses.MISSING and fld.default is not None \
                    and not isinstance(fld.default, bool) and "(default: " in helps[fld.name] \
                    and "env" not in helps[fld.name]:
                assert f"(default: {fld.default})" in helps[fld.name], (fld.name, helps[fld.name])
    assert helps["max_num_batched_tokens"].endswith("(default: 512)")
    assert helps["enable_chunked_prefill"].endswith("(default: on)")


def test_client_reads_the_prompt_from_a_file_and_stdin(serve, capsys, monkeypatch, tmp_path: Path) -> None:
    server = serve(fake_engine())
    target = ["--target", f"127.0.0.1:{server.port}", "--max-tokens", "5"]
    text = "def f(x):\n    return 'a long prompt' \\ with quotes \" and a trailing newline\n"
    path = tmp_path / "prompt.txt"
    path.write_text(text)
    expected = bytes(expected_tokens(list(text.encode()), 5)).decode()
    assert main(["client", "--prompt-file", str(path), *target]) == 0
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == expected and f"prompt {len(text.encode())} tokens" in out.err
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert main(["client", "--prompt-file", "-", *target]) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected


def test_client_prompt_errors(capsys, tmp_path: Path) -> None:
    assert main(["client", "text", "--prompt-file", "p.txt"]) == 2
    assert "give the prompt once" in capsys.readouterr().err
    assert main(["client", "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "--prompt-file: cannot read" in capsys.readouterr().err


def test_generate_takes_one_prompt_source() -> None:
    args = build_parser().parse_args(["generate", "--prompt-token-ids", "1,2,3"])
    assert (args.prompt, args.prompt_file, args.prompt_token_ids) == (None, None, [1, 2, 3])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--prompt-file", "p.txt"])


@pytest.fixture
def model_without_tokenizer(tmp_path: Path) -> Path:
    import jax

    from jaxcpp.models import checkpoint, llama
    from jaxcpp.models.config import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         eos_token_ids=(3,))
    checkpoint.save_hf(tmp_path, llama.init_params(config, jax.random.key(0)), config)
    return tmp_path


def test_generate_text_on_a_model_without_tokenizer_fails_before_loading(model_without_tokenizer, capsys,
                                                                         monkeypatch) -> None:
    def must_not_load(*args, **kwargs):
        raise AssertionError("generate loaded the model before checking for a tokenizer")

    monkeypatch.setattr("jaxcpp.LLM.from_config", must_not_load)
    assert main(["generate", "--model", str(model_without_tokenizer), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and "--prompt-token-ids" in err, err
    assert main(["generate", "--model", str(model_without_tokenizer)]) == 2  # no prompt at all
    assert "give a prompt" in capsys.readouterr().err


@pytest.mark.slow  # compiles one bucket of a 2-layer model
def test_generate_prompt_token_ids_on_a_model_without_tokenizer(model_without_tokenizer, capsys) -> None:
    argv = ["generate", "--model", str(model_without_tokenizer), "--prompt-token-ids", "5,6,7,8",
            "--max-tokens", "4", "--ignore-eos", "--temperature", "0", "--max-num-batched-tokens", "64",
            "--max-num-seqs", "4", "--log-stats-interval-s", "0"]
    assert main(argv) == 0
    out = capsys.readouterr()
    ids = [int(t) for t in out.out.strip().split(",")]
    assert len(ids) == 4 and all(0 <= t < 64 for t in ids), out.out
    assert "prompt 4 tokens, generated 4" in out.err


def test_a_missing_model_is_the_first_and_only_thing_generate_and_serve_say(tmp_path: Path, capsys,
                                                                              caplog) -> None:
    missing = str(tmp_path / "no-such-model")
    for argv in (["generate", "--model", missing, "--prompt", "hi"], ["serve", "--model", missing, "--port", "0"]):
        caplog.clear()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [f"jaxcpp {argv[0]}: error: {missing}: neither a bundled model (tiny) "
                                    "nor an existing folder"], err
        assert [r.getMessage() for r in caplog.records if r.name.startswith("jaxcpp")] == []  # no dtype line


def test_an_empty_model_folder_is_told_it_lacks_config_json_not_a_tokenizer(tmp_path: Path, capsys) -> None:
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "tokenizer" not in err, err


def test_generate_refuses_a_too_long_prompt_before_loading(capsys, monkeypatch) -> None:
    def must_not_load(*args, **kwargs):
        raise AssertionError("generate loaded the model before checking the prompt's length")

    monkeypatch.setattr("jaxcpp.LLM.from_config", must_not_load)
    assert main(["generate", "--prompt", "x" * 300, "--max-model-len", "256"]) == 2
    assert "prompt: has 300 tokens, more than --max-model-len 256" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x" * 200, "--max-model-len", "256", "--max-tokens", "100"]) == 2
    assert "max_tokens: prompt (200 tokens) + max_tokens (100) exceeds" in capsys.readouterr().err


def test_client_without_the_key_is_told_where_the_key_comes_from(serve, capsys, tmp_path: Path,
                                                                 monkeypatch) -> None:
    monkeypatch.delenv("JAXCPP_API_KEY", raising=False)
    server = serve(fake_engine(), api_key="s3cret")
    target = ["--target", f"127.0.0.1:{server.port}", "--max-tokens", "2"]
    assert main(["client", "hi", *target]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jaxcpp client: UNAUTHENTICATED: ") and "--api-key-file PATH" in err \
        and "JAXCPP_API_KEY" in err, err
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    assert main(["client", "hi", *target, "--api-key-file", str(key_file)]) == 0
    monkeypatch.setenv("JAXCPP_API_KEY", "s3cret")
    assert main(["client", "hi", *target]) == 0


def test_client_on_a_dead_address_says_nothing_listens_there(capsys) -> None:
    from tests.serving.test_client_errors import dead_target

    target = dead_target()
    assert main(["client", "hi", "--target", target]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"jaxcpp client: UNAVAILABLE: no jaxcpp server reachable at {target} within 1s ("), err
    assert "Connection refused" in err  # gRPC's cause follows the sentence


def test_client_timeout_is_also_how_long_it_waits_to_connect(capsys) -> None:
    import threading
    import time

    from jaxcpp.config import ServerConfig
    from jaxcpp.serving.lifecycle import ServerThread
    from tests.serving.test_client_errors import dead_target

    target = dead_target()
    start = time.monotonic()
    assert main(["client", "hi", "--target", target, "--timeout", "3"]) == 1
    waited = time.monotonic() - start
    err = capsys.readouterr().err
    assert f"no jaxcpp server reachable at {target} within 3s (" in err and waited >= 2.9, (waited, err)  # was: 1s
    # a server that comes up within --timeout is waited for, and answers
    servers: list[ServerThread] = []
    port = int(target.rsplit(":", 1)[1])
    later = threading.Timer(1.0, lambda: servers.append(
        ServerThread(fake_engine(), ServerConfig(port=port, http_port=0)).start()))
    later.start()
    try:
        assert main(["client", "hi", "--target", target, "--timeout", "20", "--max-tokens", "2"]) == 0, \
            capsys.readouterr().err
    finally:
        later.join()
        for server in servers:
            server.stop(grace=0)
