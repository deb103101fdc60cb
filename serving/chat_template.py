"""Chat templates: messages -> the prompt text a chat model was trained on (host side, no jax).

The template is the model's own (`chat_template` in its tokenizer_config.json, a string or a list of
named templates, "default" first), or a file given with `--chat-template`. It is rendered as
transformers renders it: jinja2 in an immutable sandbox (a template cannot reach Python objects or
change them), trim_blocks and lstrip_blocks, the loopcontrols extension, and the globals templates use
(`raise_exception`, `strftime_now`, the `tojson` filter, `bos_token` / `eos_token`). A model without a
template gets `NoChatTemplateError`, which the HTTP API answers with a 400 saying how to give one.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxcpp.errors import InvalidRequestError, ModelLoadError

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class NoChatTemplateError(InvalidRequestError):
    def __init__(self, model: str) -> None:
        super().__init__("messages", f"the model {model} has no chat template (no `chat_template` in its "
                         f"{TOKENIZER_CONFIG_FILE}): start the server with --chat-template FILE (a jinja2 "
                         "template), or use /v1/completions with your own prompt")


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self._special_tokens = special_tokens
        self._globals = frozenset(env.globals)  # range, dict, namespace, raise_exception, ...: not to be shadowed
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ModelLoadError(f"chat template does not parse: {e}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               kwargs: dict[str, Any] | None = None) -> str:
        """Raises InvalidRequestError("messages", ...) when the template refuses the conversation, and
        ("chat_template_kwargs.<key>", ...) for a keyword the renderer sets itself."""
        taken = {"messages", "add_generation_prompt", *self._special_tokens, *self._globals}
        kwargs = kwargs or {}
        for key in kwargs:
            if key in taken:
                raise InvalidRequestError(f"chat_template_kwargs.{key}", f"is set by the server; it cannot be "
                                          f"given (the server sets {', '.join(sorted(taken))})")
        try:
            return str(self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              **self._special_tokens, **kwargs))
        except TemplateError as e:  # raise_exception() in the template, or a message it cannot format
            raise InvalidRequestError("messages", f"the chat template refused them: {e}") from None


def load_chat_template(folder: Path, override: str | None) -> ChatTemplate | None:
    """`override` (a file, else the template text itself), else the model folder's own, else None."""
    config = _tokenizer_config(folder)
    special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
    if override is not None:
        return ChatTemplate(_file_or_text(override), special)
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    return ChatTemplate(source, special) if isinstance(source, str) and source else None


def _file_or_text(override: str) -> str:
    """The file's text, or `override` itself: a template longer than a file name can be is text (a path
    check on it fails with ENAMETOOLONG rather than saying False)."""
    try:
        path = Path(override)
        return path.read_text(encoding="utf-8") if path.is_file() else override
    except OSError:
        return override


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    return config if isinstance(config, dict) else {}


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or {"content": ...} (AddedToken)."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False)


def _raise(message: str) -> None:
    raise TemplateError(message)
