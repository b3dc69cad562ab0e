"""Load a model directory's tokenizer (HF `tokenizer.json` + `tokenizer_config.json`) and chat template.

Encoding and decoding run in the Rust `tokenizers` library; transformers is not imported here
(it is only the reference in tests). The loading rules follow transformers' generic fast
tokenizer so that ids match it exactly: the `tokenizer.json` pipeline is used as written
(including its post-processor, which is where a BOS token is added or not; transformers ignores
`add_bos_token` in the config when a `tokenizer.json` exists), named special tokens from the
config are added if the vocabulary lacks them, and `chat_template.jinja` /
`additional_chat_templates/*.jinja` take priority over the config's `chat_template`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

from tokenline.frontend.chat_template import ChatTemplateError, compile_template, plain_data, render_chat_template
from tokenline.frontend.user_text import RenderedChat, SpecialTokenGuard

__all__ = ["Tokenizer"]

# The named special tokens transformers exposes to chat templates (`special_tokens_map`).
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token as written in a config: a string or a serialized AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _load_chat_templates(model_dir: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Templates by name ("default" for the main one)."""
    templates: dict[str, str] = {}
    main = model_dir / "chat_template.jinja"
    if main.is_file():
        templates["default"] = main.read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if templates:
        # Template files replace whatever the config holds, as in transformers.
        return templates
    legacy = config.get("chat_template")
    if isinstance(legacy, str):
        return {"default": legacy}
    if isinstance(legacy, list):
        return {t["name"]: t["template"] for t in legacy if isinstance(t, Mapping) and "name" in t}
    return {}


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


_UNICODE_TO_BYTE = {c: b for b, c in byte_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens


class Tokenizer:
    """A model's tokenizer: text <-> ids, special tokens, and its chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        extra_special_tokens: Sequence[str] = (),
    ) -> None:
        self._backend = backend
        self._special_tokens = dict(special_tokens or {})
        self._chat_templates = dict(chat_templates or {})

        # transformers registers every named special token as an added special token on load
        # (new ones get fresh ids; ones already in the base vocabulary keep theirs but are then
        # matched whole and skipped on decode). Tokens already registered keep their flags.
        registered = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [
            tokenizers.AddedToken(t, special=True, normalized=False)
            for t in dict.fromkeys([*self._special_tokens.values(), *extra_special_tokens])
            if t not in registered
        ]
        if missing:
            backend.add_special_tokens(missing)

        vocab = backend.get_vocab(with_added_tokens=True)
        # Ids may have gaps (added tokens placed past the base vocabulary), so count up to the largest.
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        # The ids decode(skip_special_tokens=True) drops: added tokens flagged special.
        self._special_ids = sorted(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._special_id_set = frozenset(self._special_ids)
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
        self._byte_level = "ByteLevel" in kinds

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` and the chat template(s) from an HF model directory."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(model_dir / "tokenizer_config.json")

        entries: dict[str, Any] = dict(config)
        if "added_tokens_decoder" not in config:
            # Legacy layout: special_tokens_map.json is only consulted (and wins) when the config
            # does not serialize its added tokens, as in transformers.
            entries.update(_read_json(model_dir / "special_tokens_map.json"))

        special: dict[str, str] = {}
        for key, value in entries.items():
            # Standard names plus model-specific ones such as `image_token`.
            if key in _NAMED_SPECIAL_TOKENS or key.endswith("_token"):
                text = _token_text(value)
                if text is not None:
                    special[key] = text
        extra_cfg = entries.get("extra_special_tokens", entries.get("additional_special_tokens"))
        extra: list[str] = []
        if isinstance(extra_cfg, Mapping):
            for key, value in extra_cfg.items():
                if (text := _token_text(value)) is not None:
                    special[key] = text
        elif isinstance(extra_cfg, list):
            extra = [t for t in map(_token_text, extra_cfg) if t is not None]

        added_missing = []
        for token in (config.get("added_tokens_decoder") or {}).values():
            text = _token_text(token)
            if text is not None and backend.token_to_id(text) is None:
                added_missing.append(
                    tokenizers.AddedToken(
                        text,
                        special=bool(token.get("special", False)),
                        normalized=bool(token.get("normalized", not token.get("special", False))),
                        lstrip=bool(token.get("lstrip", False)),
                        rstrip=bool(token.get("rstrip", False)),
                        single_word=bool(token.get("single_word", False)),
                    )
                )
        if added_missing:
            backend.add_tokens(added_missing)
        if config.get("split_special_tokens"):
            backend.encode_special_tokens = True

        return cls(backend, special, _load_chat_templates(model_dir, config), extra)

    # -- ids <-> text ---------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The Rust tokenizer (for DecodeStream and batch calls)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True, parse_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a BOS token).
        `parse_special_tokens=False`: special-token strings in `text` are tokenized as text (user text)."""
        backend = self._backend if parse_special_tokens else self.guard.text_backend
        # encode_batch, not encode: only the batch call releases the GIL while it works (tokenizers
        # 0.23), so a large prompt tokenized on a text-pool thread does not stall the event loop.
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @cached_property
    def guard(self) -> SpecialTokenGuard:
        """Keeps special-token strings in user text from becoming special tokens (built on first use)."""
        return SpecialTokenGuard(self._backend)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (logprobs report them: a byte-level token may hold
        only part of a UTF-8 character, which decoding alone shows as U+FFFD)."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id not in self._special_id_set:
            if self._byte_level and all(c in _UNICODE_TO_BYTE for c in token):
                return bytes(_UNICODE_TO_BYTE[c] for c in token)
            if (byte := _BYTE_FALLBACK.fullmatch(token)) is not None:
                return bytes([int(byte.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def added_token_ids(self, texts: Sequence[str]) -> dict[str, int]:
        """Ids of those ``texts`` that the vocabulary holds as single added tokens."""
        added = {t.content: i for i, t in self.backend.get_added_tokens_decoder().items()}
        return {text: added[text] for text in texts if text in added}

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (largest id + 1, added tokens included)."""
        return self._vocab_size

    # -- special tokens -------------------------------------------------------------------------

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens (bos_token, eos_token, ...): the chat template sees these as variables."""
        return dict(self._special_tokens)

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._backend.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self._backend.token_to_id(self.eos_token) if self.eos_token is not None else None

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every added token flagged special: exactly what `decode(skip_special_tokens=True)` drops."""
        return list(self._special_ids)

    # -- chat -----------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None if the model has none."""
        return self._chat_templates.get("default")

    @property
    def chat_templates(self) -> dict[str, str]:
        """All named templates (most models have only "default")."""
        return dict(self._chat_templates)

    def set_chat_template(self, template: str) -> None:
        """Replace the model's templates (vLLM's ``--chat-template``): this one renders every
        conversation, with tools or without."""
        self._chat_templates = {"default": template}

    def warm_up(self) -> dict[str, str]:
        """Build now what the first request would otherwise wait for: the user-text copy of the
        tokenizer (``guard``: ~0.1 s for SmolLM2's vocabulary) and every chat template compiled.
        Returns the templates that do not compile (name -> error): chats that need them are refused."""
        self.guard  # noqa: B018 - a cached_property: reading it builds it
        broken = {}
        for name, template in self._chat_templates.items():
            try:
                compile_template(template)
            except ChatTemplateError as exc:
                broken[name] = str(exc)
        return broken

    def pick_template(self, tools: Sequence[Any] | None) -> str:
        """The template that renders a conversation with these ``tools`` (ChatTemplateError if none)."""
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        if self._chat_templates:
            raise ChatTemplateError(
                f"model has several chat templates and no default: {sorted(self._chat_templates)}"
            )
        # As vLLM: no default template is made up (a pretrained model's file often has none).
        raise ChatTemplateError("the model has no chat template: start the server with --chat-template (a file "
                                "or an inline Jinja template), or send a plain prompt to /v1/completions")

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        parse_special_tokens: bool = False,
    ) -> RenderedChat:
        """Render the conversation for `encode_chat`: special-token strings in any caller string
        (contents, names, tool calls and results, tool schemas, template kwargs) stay text, unless
        `parse_special_tokens` (the operator's opt-in). The text is `apply_chat_template`'s."""
        template = self.pick_template(tools)

        def render(messages: Any, tools: Any, kwargs: Any) -> str:
            return self._render(template, messages, add_generation_prompt, continue_final_message, tools, kwargs)

        if parse_special_tokens:
            return RenderedChat(render(messages, tools, chat_template_kwargs))  # all of it template text
        data = plain_data([list(messages), list(tools) if tools is not None else None, dict(chat_template_kwargs or {})])
        (messages, tools, kwargs), originals = self.guard.escape(data, avoid=template)
        marked = render(messages, tools, kwargs)
        return RenderedChat(self.guard.restore(marked, originals), marked, originals)

    def encode_chat(self, rendered: str) -> list[int]:
        """Ids of a rendered conversation: the template's special tokens are special ids, caller
        text is text (for benign input, exactly `encode(rendered, add_special_tokens=False)`).
        Plain text (not a `RenderedChat`) is all template: its special-token strings are parsed."""
        if not isinstance(rendered, RenderedChat) or not rendered.originals:
            return self.encode(rendered, add_special_tokens=False)
        return self.guard.encode(rendered)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> str:
        """Render the conversation to prompt text (not tokenized; encode it with add_special_tokens=False).

        `chat_template` overrides the model's own (a template source, or the name of one of its templates).
        """
        if chat_template is None:
            template = self.pick_template(tools)
        else:
            template = self._chat_templates.get(chat_template, chat_template)
        return self._render(template, messages, add_generation_prompt, continue_final_message, tools, chat_template_kwargs)

    def _render(
        self,
        template: str,
        messages: Any,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        tools: Any,
        chat_template_kwargs: Any,
    ) -> str:
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            special_tokens=self._special_tokens,
            chat_template_kwargs=chat_template_kwargs,
        )
