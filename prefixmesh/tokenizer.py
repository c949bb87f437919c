"""A torch-free tokenizer: the ``tokenizers`` library plus jinja2 chat templates.

The router and the replicas must turn a prompt into exactly the same token ids (block hashes are
computed on them), and the router must not import torch or transformers. This class reproduces
what ``transformers.AutoTokenizer`` does for a fast (``tokenizer.json``) tokenizer: the same
post-processor rules for ``add_bos_token``/``add_eos_token``, and chat templates rendered in the
same sandboxed jinja2 environment with the same globals.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


class Tokenizer:
    """Encode, decode and render chat templates for one model's tokenizer files.

    Build with :meth:`from_dir` (a model folder) or :meth:`from_bytes` (the raw
    ``tokenizer.json`` / ``tokenizer_config.json`` a router receives from a replica).
    ``tokenizer_config_json`` always carries the chat template, even when the folder stored it
    in ``chat_template.jinja``, so the bytes are self-contained.
    """

    def __init__(
        self,
        tokenizer_json: bytes,
        tokenizer_config_json: bytes,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self.tokenizer_json = bytes(tokenizer_json)
        self.tokenizer_config_json = bytes(tokenizer_config_json)
        self.config: dict[str, Any] = json.loads(self.tokenizer_config_json or b"{}")
        self.backend = BackendTokenizer.from_str(self.tokenizer_json.decode("utf-8"))
        self.backend.encode_special_tokens = bool(self.config.get("split_special_tokens", False))
        self.special_tokens: dict[str, str] = {
            key: text
            for key in SPECIAL_TOKEN_KEYS
            if (text := _token_text(self.config.get(key))) is not None
        }
        self._apply_bos_eos_rules()
        self.chat_template: str | None = _pick_chat_template(self.config.get("chat_template"))
        self.bos_token_id = self._token_id("bos_token")
        eos = {i for i in (self._token_id("eos_token"),) if i is not None}
        self.eos_token_ids: frozenset[int] = frozenset(eos | {int(i) for i in extra_eos_ids})
        self.vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)
        self.all_special_ids: frozenset[int] = frozenset(
            tid for tid, tok in self.backend.get_added_tokens_decoder().items() if tok.special
        ) | {i for key in self.special_tokens if (i := self._token_id(key)) is not None}
        self._is_bpe = json.loads(self.tokenizer_json).get("model", {}).get("type") == "BPE"

    @classmethod
    def from_bytes(
        cls,
        tokenizer_json: bytes,
        tokenizer_config_json: bytes,
        extra_eos_ids: Iterable[int] = (),
    ) -> Tokenizer:
        """Build from raw file contents; ``extra_eos_ids`` adds ids from generation_config."""
        return cls(tokenizer_json, tokenizer_config_json, extra_eos_ids)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a model folder (tokenizer.json, tokenizer_config.json, and optionally
        chat_template.jinja, config.json and generation_config.json for extra eos ids)."""
        folder = Path(path)
        tokenizer_json = (folder / "tokenizer.json").read_bytes()
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_bytes()) if config_file.is_file() else {}
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            # transformers >= 4.43 saves the template beside the config; it takes precedence.
            config["chat_template"] = template_file.read_text(encoding="utf-8")
        extra: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            file = folder / name
            if file.is_file():
                extra |= set(as_token_ids(json.loads(file.read_bytes()).get("eos_token_id")))
        return cls(tokenizer_json, json.dumps(config).encode("utf-8"), extra)

    # -- encoding -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; equals ``AutoTokenizer.encode`` on the same files."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string (got {type(text).__name__})")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.config.get("clean_up_tokenization_spaces") and not self._is_bpe:
            text = _clean_up_tokenization(text)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # -- chat -------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` as ``AutoTokenizer.apply_chat_template(..., tokenize=False)``."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template; send a plain prompt instead")
        chat = _validate_messages(messages)
        kwargs = {**self.special_tokens, **template_kwargs}
        try:
            return self._compiled_template.render(
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat (special tokens come from the template only)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        assert self.chat_template is not None
        return _jinja_env().from_string(self.chat_template)

    # -- helpers ----------------------------------------------------------------------------

    def _token_id(self, key: str) -> int | None:
        text = self.special_tokens.get(key)
        return None if text is None else self.backend.token_to_id(text)

    def _apply_bos_eos_rules(self) -> None:
        """Rebuild the post-processor from add_bos_token/add_eos_token, as transformers does."""
        explicit = "add_bos_token" in self.config or "add_eos_token" in self.config
        if not explicit and self.backend.post_processor is not None:
            return
        add_bos = bool(self.config.get("add_bos_token", False))
        add_eos = bool(self.config.get("add_eos_token", False))
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        add_bos = add_bos and bos is not None
        add_eos = add_eos and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        special = []
        if add_bos:
            special.append((bos, self.backend.token_to_id(bos)))
        if add_eos:
            special.append((eos, self.backend.token_to_id(eos)))
        self.backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special
        )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def as_token_ids(value: Any) -> list[int]:
    """A config's ``eos_token_id``-style value (None, one id or a list) as a list of ids."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _pick_chat_template(value: Any) -> str | None:
    """A template string; for the list-of-named-templates form, the one named "default"."""
    if isinstance(value, str) or value is None:
        return value
    named = {t["name"]: t["template"] for t in value}
    return named.get("default")


def _validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and contents, and drop None values as transformers does."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role', 'content'} objects")
    if not messages:
        raise ValueError("messages must not be empty")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object (got {type(message).__name__})")
        if "role" not in message:
            raise ValueError(f"messages[{i}].role is missing")
        if not isinstance(message["role"], str) or not message["role"]:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        if message.get("content") is None:
            raise ValueError(f"messages[{i}].content is missing")
        if not isinstance(message["content"], (str, list)):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of parts "
                f"(got {type(message['content']).__name__})"
            )
        chat.append({k: v for k, v in message.items() if v is not None})
    return chat


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):  # fmt: skip
        text = text.replace(before, after)
    return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (assistant-mask markers) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """A jinja namespace that refuses dunder names (as transformers' sandbox does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes ({name!r})"
            )


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env
