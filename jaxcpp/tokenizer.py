"""Tokenizers (host side, no jax): text <-> token ids, and streaming detokenization.

Two implementations of one small `Tokenizer` protocol: `ByteTokenizer` (the bundled tiny model's: ids
0..255 are the bytes themselves, then BOS/EOS/PAD) and `HFTokenizer` (a Hugging Face `tokenizer.json`
through the Rust `tokenizers` package). `IncrementalDetokenizer` turns a growing list of generated ids
into text deltas that never split a multi-byte UTF-8 character; the server streams these deltas.
`load_tokenizer(folder, config)` picks the one a model folder carries.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from jaxcpp.errors import ModelLoadError

if TYPE_CHECKING:
    from jaxcpp.models.config import LlamaConfig

HF_TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
BYTE_TOKENIZER_FILE = "byte_tokenizer.json"  # marks a folder whose model reads raw UTF-8 bytes
REPLACEMENT_CHAR = "\ufffd"


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; BOS, EOS and PAD follow. `encode` adds no BOS: the caller decides."""

    NUM_BYTES = 256

    def __init__(self, bos_token_id: int = 256, eos_token_id: int = 257, pad_token_id: int = 258) -> None:
        specials = (bos_token_id, eos_token_id, pad_token_id)
        if min(specials) < self.NUM_BYTES or len(set(specials)) != 3:
            raise ValueError(f"special ids must be distinct and >= 256, got {specials}")
        self._bos, self._eos, self.pad_token_id = specials

    @property
    def vocab_size(self) -> int:
        return max(self._bos, self._eos, self.pad_token_id) + 1

    @property
    def bos_token_id(self) -> int:
        return self._bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self._eos,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Special and out-of-range ids are dropped; invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < self.NUM_BYTES).decode("utf-8", errors="replace")

    def save(self, folder: str | Path) -> None:
        spec = {"type": "byte", "bos_token_id": self._bos, "eos_token_id": self._eos,
                "pad_token_id": self.pad_token_id}
        (Path(folder) / BYTE_TOKENIZER_FILE).write_text(json.dumps(spec, indent=2) + "\n")

    @staticmethod
    def from_file(path: str | Path) -> ByteTokenizer:
        try:
            spec = json.loads(Path(path).read_text())
            return ByteTokenizer(spec["bos_token_id"], spec["eos_token_id"], spec["pad_token_id"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{path}: bad byte tokenizer spec ({e!r})") from None


class HFTokenizer:
    """A Hugging Face `tokenizer.json`; special-token ids come from the model config."""

    def __init__(self, path: str | Path, bos_token_id: int | None = None,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        try:
            self._tok = _RustTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises its own exception type
            raise ModelLoadError(f"{path}: cannot load tokenizer ({e})") from None
        self._bos = bos_token_id
        self._eos = tuple(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def encode(self, text: str) -> list[int]:
        # No template specials: the engine adds BOS itself where the model wants one.
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def to_json(self) -> str:
        """The whole tokenizer as `tokenizer.json` text (what the grammar library builds its own from)."""
        return str(self._tok.to_str())


class IncrementalDetokenizer:
    """Feed generated ids one step at a time; get back only the text that is complete so far.

    Decodes a short window of ids and diffs it against the same window without the newest ids (the
    vLLM/TGI scheme): decoding a window rather than everything keeps each step O(1), and starting the
    window a few ids back lets tokenizers that strip a leading space decode in context. A delta that
    ends in U+FFFD is a UTF-8 character still missing bytes, so it is held back until more ids arrive
    (or `flush()` at the end of the sequence).
    """

    CONTEXT_IDS = 6  # ids of already-emitted text kept in the window for context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-self.CONTEXT_IDS:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this are emitted

    def step(self, new_ids: int | Sequence[int]) -> str:
        self._ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = text[len(prefix_text):]
        self._prefix = max(self._read, len(self._ids) - self.CONTEXT_IDS)
        self._read = len(self._ids)
        self._trim()
        return delta

    def flush(self) -> str:
        """The rest, even if it ends in an incomplete character (shown as U+FFFD)."""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text):]

    def _trim(self) -> None:
        if self._prefix > 4 * self.CONTEXT_IDS:  # keep memory flat on long generations
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0


def load_tokenizer(folder: str | Path, config: LlamaConfig) -> Tokenizer | None:
    """The folder's tokenizer: `tokenizer.json` (HF), `byte_tokenizer.json` (bytes), else None."""
    folder = Path(folder)
    if (folder / HF_TOKENIZER_FILE).is_file():
        return HFTokenizer(folder / HF_TOKENIZER_FILE, config.bos_token_id, config.eos_token_ids)
    if (folder / BYTE_TOKENIZER_FILE).is_file():
        tok = ByteTokenizer.from_file(folder / BYTE_TOKENIZER_FILE)
        if tok.vocab_size > config.vocab_size:
            raise ModelLoadError(f"{folder / BYTE_TOKENIZER_FILE}: needs {tok.vocab_size} ids but "
                                 f"config.json has vocab_size={config.vocab_size}")
        return tok
    if (folder / TOKENIZER_CONFIG_FILE).is_file():  # it says it has a tokenizer: the file is missing
        raise ModelLoadError(f"{folder / HF_TOKENIZER_FILE}: not found, but {TOKENIZER_CONFIG_FILE} says this "
                             "model has a tokenizer (jaxcpp reads tokenizer.json; a folder with neither "
                             "file serves token ids only)")
    return None
