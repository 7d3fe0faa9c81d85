"""The checkpoint's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, plus its chat
template and special tokens from ``tokenizer_config.json`` (and ``chat_template.jinja`` /
``generation_config.json`` where present).

``tokenizers`` and ``jinja2`` are optional dependencies: they are imported when used, and a clear
error says what to install when they are missing. Chat templates render in a sandboxed jinja2
environment configured like transformers' (trim_blocks, lstrip_blocks, ``raise_exception``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer; build with ``Tokenizer.from_dir(checkpoint_dir)``."""

    backend: Any  # tokenizers.Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the optional config files of a checkpoint directory."""
        try:
            from tokenizers import Tokenizer as Backend
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ValueError(
                "reading tokenizer.json needs the `tokenizers` package: pip install tokenizers"
            ) from exc
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: mlaq reads the fast tokenizer's tokenizer.json"
            )
        backend = Backend.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        template = _chat_template(path, config)
        eos_ids: list[int] = []
        for source in (_read_json(path / "generation_config.json"), _read_json(path / "config.json")):
            eos_ids += _as_ids(source.get("eos_token_id"))
        if eos is not None and backend.token_to_id(eos) is not None:
            eos_ids.append(backend.token_to_id(eos))
        return cls(backend, bos, eos, tuple(dict.fromkeys(eos_ids)), template)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the checkpoint's template.

        The result already holds the template's special tokens: encode it with
        ``add_special_tokens=False`` (as vLLM does for chat requests).
        """
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja); pass a plain prompt instead"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], **variables: Any) -> str:
    """Render a Hugging Face chat template (jinja2, sandboxed, transformers' settings)."""
    try:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError("chat templates need the `jinja2` package: pip install jinja2") from exc

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template error: {message}")

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=list(messages), **variables)
    except TemplateError as exc:
        raise ValueError(f"chat template failed to render: {exc}") from exc


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, found {type(value).__name__}")
    return value


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as text or as a serialised AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():  # newer transformers save the template as its own file
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None
