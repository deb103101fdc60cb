"""Pipeline fixtures: small random Llamas written as Hugging Face folders, and engines on them.

The main model is random on purpose: 6 layers, so 4 stages split unevenly by default; 2 KV heads, so
TP=2 shards the KV pages; an untied LM head, so TP shards the vocabulary. A second one has one KV head
(TP keeps the pages replicated) and tied embeddings (the last stage needs the embedding as its head).
Weights are scaled up so greedy choices are not near-ties that float32 summation order could flip.
Engines are cached per configuration for the module: building one compiles its programs.
"""

from __future__ import annotations

import os

import pytest


def random_params(config, seed: int):
    """`config`'s random params with every weight scaled x3, so greedy choices are not near-ties that
    float32 summation order could flip."""
    import jax

    from jaxcpp.models.llama import init_params

    return jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, init_params(config, jax.random.key(seed)))


def write_random_model(folder, *, num_layers: int = 6, num_kv_heads: int = 2, tied: bool = False,
                       hidden_size: int = 64, intermediate_size: int = 128, num_heads: int = 4,
                       max_position_embeddings: int = 512) -> str:
    from jaxcpp.models.checkpoint import save_hf
    from jaxcpp.models.config import LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=tied, eos_token_ids=(1,),
                         bos_token_id=0)
    save_hf(folder, random_params(config, 7), config)
    return str(folder)


@pytest.fixture(scope="session")
def random_model(tmp_path_factory) -> str:
    return write_random_model(tmp_path_factory.mktemp("pp_model"))


@pytest.fixture(scope="session")
def mqa_tied_model(tmp_path_factory) -> str:
    return write_random_model(tmp_path_factory.mktemp("pp_model_mqa"), num_layers=4, num_kv_heads=1, tied=True)


def child_pids(pid: int) -> list[int]:
    """The live child processes of `pid`, oldest first, from every process's parent in /proc (a thread's
    `task/TID/children` lists only what that thread forked, and the server spawns its stages from the
    thread that builds the engine, not the main one)."""
    children = []  # (start time, pid)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 onwards
            except OSError:  # gone meanwhile
                continue
            if int(fields[1]) == pid:  # field 4: the parent; field 22: the start time
                children.append((int(fields[19]), int(entry)))
    return [child for _, child in sorted(children)]


ENGINE_DEFAULTS = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
                       page_size=16, log_stats_interval_s=0)


@pytest.fixture(scope="session")
def make_pp_llm():
    """A fresh offline engine; keyword arguments are engine flags (model= is required)."""
    from jaxcpp import LLM

    def make(**kwargs):
        return LLM(record_logits=True, **{**ENGINE_DEFAULTS, **kwargs})

    return make


@pytest.fixture(scope="module")
def pp_llm(make_pp_llm):
    """Like make_pp_llm, but one engine per distinct configuration for the whole module (no engine outlives
    its module: tests/conftest.py drops the compiled programs after each)."""
    engines = {}

    def get(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in engines:
            engines[key] = make_pp_llm(**kwargs)
        return engines[key]

    yield get
    for llm in engines.values():
        close = getattr(llm.engine.executor, "close", None)
        if close is not None:
            close()
