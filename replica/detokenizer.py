"""Incremental detokenization: text deltas per generated token (stop strings are matched on
them by ``prefixmesh/stop_strings.py``).

Guarantee of :class:`IncrementalDetokenizer`: the concatenation of ``add()`` results equals
``tokenizer.decode(output_ids)`` whenever that decode holds no U+FFFD (byte-level tokenizers such
as SmolLM2's/GPT-2's; the prompt is used as left context so the first token's leading space is
right). Byte sequences that are not valid UTF-8 can differ only in U+FFFD characters, and bytes
of a character still incomplete when generation stops are never emitted (``decode`` would show
U+FFFD for them). A delta is never a broken character: a multibyte character split over several
byte-level tokens comes out whole, in the step that completes it.
"""

from __future__ import annotations

import os
from typing import Any

try:  # tokenizers >= 0.21: the whole step runs in Rust.
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers
    DecodeStream = None

# Prompt tokens kept as left context, as vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET.
_PROMPT_CONTEXT = 5
# A window can start inside a multibyte character: keep this many tokens before the read point.
_WINDOW = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one ``add()`` per token.

    ``tokenizer`` is a ``prefixmesh.tokenizer.Tokenizer`` (its ``.backend`` is used) or a
    ``tokenizers.Tokenizer``. Uses ``tokenizers.decoders.DecodeStream`` primed with the prompt's
    tail; if that refuses a step (its prefix check fails, e.g. a prompt ending mid-character),
    this sample switches to the same prefix/read-offset algorithm in Python, as vLLM's.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tok = getattr(tokenizer, "backend", tokenizer)
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        # ids the Python fallback would need: prompt context + outputs, and how far text is out.
        self._ids: list[int] = context
        self._read = len(context)
        self._prefix = max(0, self._read - _WINDOW)
        self._stream = None
        # DecodeStream re-emits a prefill whose text ends in an incomplete character.
        if DecodeStream is not None and not self._decode(context).endswith(_REPLACEMENT):
            self._stream = DecodeStream(context, skip_special_tokens)
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ('' if none yet)."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._tok, token_id)
            except Exception:  # noqa: BLE001 - DecodeStream's prefix check; fall back below
                self._stream = None
            else:
                if delta is None:
                    return ""
                self._mark_read()
                self._text += delta
                return delta
        return self._add_python()

    def _mark_read(self) -> None:
        self._read = len(self._ids)
        self._prefix = max(0, self._read - _WINDOW)
        # Bound memory on long generations: the fallback only needs the window.
        if self._prefix > 4 * _WINDOW:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _add_python(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or a character still incomplete
        if new_text.startswith(prefix_text):
            delta = new_text[len(prefix_text) :]
        else:
            # New bytes completed a character the context ended with (shown as U+FFFD there):
            # emit from the first difference, so the completed character comes out whole.
            delta = new_text[len(os.path.commonprefix([prefix_text, new_text])) :]
        self._mark_read()
        self._text += delta
        return delta


def resumed_text(
    tokenizer: Any,
    prompt_token_ids: list[int],
    resumed_ids: list[int],
    skip_special_tokens: bool = True,
) -> str:
    """The text a sample's detokenizer emits for ``resumed_ids`` generated after the prompt:
    what the replica that generated them streamed, before stop-string hold-back."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    for token_id in resumed_ids:
        detokenizer.add(token_id)
    return detokenizer.text
