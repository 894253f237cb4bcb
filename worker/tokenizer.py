"""Tokenizer for HF-format checkpoints: encode/decode via ``tokenizer.json`` and chat templates
(streaming detokenization: :mod:`worker.detokenizer`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

from worker.byte_level import byte_level_tables
from worker.detokenizer import ByteLevelDecoder, IncrementalDecoder
from worker.tokenizer_bounds import max_bytes_per_token

__all__ = ["ChatTemplateError", "DEFAULT_CHAT_TEMPLATE", "Tokenizer", "load_tokenizer"]

DEFAULT_CHAT_TEMPLATE = """{%- for message in messages %}
    {{- message['role'] + ': ' + message['content'] + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- 'assistant: ' }}
{%- endif %}
"""
"""Used when a checkpoint has no chat template: one ``"role: content\\n"`` line per message,
then ``"assistant: "`` when a generation prompt is requested.  No special tokens are inserted
(``encode(..., add_special_tokens=True)`` still adds BOS where the family does)."""

class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (``raise_exception``) or failed to render."""


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or a serialized AddedToken."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unrecognized special token entry: {value!r}")


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class _GenerationTag(jinja2.ext.Extension):
    # HF templates may mark assistant spans with {% generation %}...{% endgeneration %}; render the body.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    # Like HF: templates may not store underscore-prefixed attributes on a namespace().
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile with the same environment conventions as HF transformers' apply_chat_template."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e


class Tokenizer:
    """A checkpoint's tokenizer (HF ``tokenizer.json`` + ``tokenizer_config.json``).

    Encoding matches ``transformers.AutoTokenizer``: BOS/EOS are added by ``tokenizer.json``'s
    post-processor, or -- when it has none -- per ``add_bos_token``/``add_eos_token`` in
    ``tokenizer_config.json``.
    """

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        tokenizer_config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        model_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        source: str | Path | None = None,
    ) -> None:
        """Wrap a ``tokenizers.Tokenizer``; the mappings are the checkpoint's JSON files."""
        self._backend = backend
        self._source = str(source) if source is not None else "<in-memory>"
        tcfg = dict(tokenizer_config or {})
        gcfg = dict(generation_config or {})
        mcfg = dict(model_config or {})

        self.bos_token: str | None = _token_content(tcfg.get("bos_token"))
        self.eos_token: str | None = _token_content(tcfg.get("eos_token"))
        self.unk_token: str | None = _token_content(tcfg.get("unk_token"))
        self.pad_token: str | None = _token_content(tcfg.get("pad_token"))

        if "bos_token" in tcfg:
            self.bos_token_id: int | None = self._required_id(self.bos_token)
        else:
            fallback = gcfg.get("bos_token_id", mcfg.get("bos_token_id"))
            self.bos_token_id = None if fallback is None else int(fallback)
            if self.bos_token_id is not None:
                self.bos_token = backend.id_to_token(self.bos_token_id)
        self.eos_token_id: int | None = self._required_id(self.eos_token)
        if self.eos_token is None:
            ids = _id_list(gcfg.get("eos_token_id", mcfg.get("eos_token_id")))
            if ids:
                self.eos_token_id = ids[0]
                self.eos_token = backend.id_to_token(ids[0])
        self.pad_token_id: int | None = self._required_id(self.pad_token)

        eos_ids = _id_list(gcfg.get("eos_token_id")) or _id_list(mcfg.get("eos_token_id"))
        if not eos_ids and self.eos_token_id is not None:
            eos_ids = [self.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        """Ids that end generation: generation_config.json's ``eos_token_id`` (int or list),
        else config.json's, else the tokenizer's EOS token."""

        # tokenizer.json's post-processor is authoritative (as in transformers' fast tokenizers);
        # add_bos_token/add_eos_token only apply to a tokenizer.json without one.
        self._manual_specials = backend.post_processor is None
        self._add_bos = bool(tcfg.get("add_bos_token", False)) and self.bos_token_id is not None
        self._add_eos = bool(tcfg.get("add_eos_token", False)) and self.eos_token_id is not None

        template = chat_template if chat_template is not None else tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        self.chat_template: str | None = template
        """The checkpoint's jinja chat template (None: :data:`DEFAULT_CHAT_TEMPLATE` is used)."""

    def _required_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self._source}: special token {token!r} is not in the vocabulary")
        return token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a checkpoint directory holding ``tokenizer.json`` (required) and optionally
        ``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json``, ``config.json``."""
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {root}")
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"tokenizer file not found: {tok_file} (a HF fast-tokenizer tokenizer.json is required)"
            )
        try:
            backend = _BackendTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise ValueError(f"cannot load {tok_file}: {e}") from e
        template_file = root / "chat_template.jinja"
        chat_template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        return cls(
            backend,
            tokenizer_config=_read_json(root / "tokenizer_config.json"),
            generation_config=_read_json(root / "generation_config.json"),
            model_config=_read_json(root / "config.json"),
            chat_template=chat_template,
            source=root,
        )

    @property
    def backend(self) -> _BackendTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @cached_property
    def vocab_size(self) -> int:
        """Number of token ids (base vocabulary plus added tokens)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_bytes_per_token(self) -> int | None:
        """Most UTF-8 bytes of text one token can stand for (None: unbounded); see :mod:`worker.tokenizer_bounds`."""
        return max_bytes_per_token(self._backend.to_str())

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` (None if unknown)."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of ``token_id`` (None if out of range)."""
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` adds BOS/EOS as the checkpoint declares.

        Text rendered by :meth:`apply_chat_template` usually already contains BOS; encode it
        with ``add_special_tokens=False``.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        if not self._manual_specials:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self._add_bos:
                ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
            if self._add_eos:
                ids.append(self.eos_token_id)  # type: ignore[arg-type]
        return ids

    def decode_batch(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """:meth:`decode` of each of ``sequences`` in one call (the backend decodes them outside the GIL)."""
        try:
            return self._backend.decode_batch([list(ids) for ids in sequences], skip_special_tokens=skip_special_tokens)
        except OverflowError as e:
            raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from e

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids without a token are dropped (as HF does)."""
        try:
            return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        except OverflowError as e:
            raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from e

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        return _compile_chat_template(self.chat_template if self.chat_template is not None else DEFAULT_CHAT_TEMPLATE)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template.

        Same variables and environment as ``transformers``' ``apply_chat_template(...,
        tokenize=False)``: ``messages``, ``add_generation_prompt``, the special token strings
        (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``), ``tools``/``documents``
        (None) and any extra ``kwargs`` (e.g. ``enable_thinking=False``).  Raises
        :class:`ChatTemplateError` if the template rejects the conversation.
        """
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        plain = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise TypeError(f"messages[{i}] must be a dict with a string 'role', got {message!r}")
            plain.append(dict(message))
        variables: dict[str, Any] = {"tools": None, "documents": None}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = getattr(self, name)
            if value is not None:
                variables[name] = value
        variables.update(kwargs)
        variables["messages"] = plain
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return self._compiled_template.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e)) from e

    @cached_property
    def byte_level_tables(self) -> dict[bool, tuple[bytes, ...]] | None:
        """Each token's bytes per ``skip_special_tokens`` when the decoder is byte-level and the table
        agrees with it (:func:`worker.byte_level.byte_level_tables`), else None; built on first use."""
        return byte_level_tables(self._backend)

    def incremental_decoder(
        self, skip_special_tokens: bool = True, prefix_ids: Sequence[int] = ()
    ) -> IncrementalDecoder | ByteLevelDecoder:
        """A new streaming decoder over this tokenizer: a :class:`ByteLevelDecoder` (no tokenizer calls
        per token) when the tokenizer is byte-level and ``prefix_ids`` end on a whole character (the
        two emit the same then), else an :class:`IncrementalDecoder`."""
        tables = self.byte_level_tables
        if tables is not None:
            tail = b"".join(tables[skip_special_tokens][i] for i in prefix_ids[-IncrementalDecoder.PREFIX_CONTEXT:]
                            if 0 <= i < len(tables[skip_special_tokens]))
            if not tail.decode("utf-8", "replace").endswith("\ufffd"):
                return ByteLevelDecoder(self, tables[skip_special_tokens], skip_special_tokens)
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens, prefix_ids=prefix_ids)

    def __repr__(self) -> str:
        return f"Tokenizer({self._source!r}, vocab_size={self.vocab_size})"


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer of checkpoint ``model_dir``, or None when it has no ``tokenizer.json`` (its prompts
    are token ids and its outputs have no text)."""
    root = Path(model_dir)
    return Tokenizer.from_dir(root) if (root / "tokenizer.json").is_file() else None
