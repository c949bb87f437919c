"""Stop-string matching on streamed text, shared by the replica engine and the echo replica.

Torch-free (no imports at all), so ``loadtest/echo_replica.py`` holds text back exactly as a real
replica does and checks ``resume_text_chars`` the same way (:func:`unsent_text`).
"""

from __future__ import annotations


class StopStringMatcher:
    """Finds stop strings in streamed text, also when split across steps.

    ``feed(new_text)`` returns ``(text_to_emit, matched_stop)``. Any tail that could begin a
    stop string is held back until the next text decides it, so a stop string is never partly
    emitted. On a match the emitted text ends right before the stop string (right after it with
    ``include_stop_str_in_output``) and the matcher is done. The first stop string to be
    completed wins; among several completed by the same ``feed``, the one starting earliest
    (then the one listed first). ``flush()`` returns what is held back when the sample
    ends for another reason. With no stop strings ``feed`` passes text straight through.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, str | None]:
        if not self.stop:
            return text, None
        if self.matched is not None:
            return "", None
        buf = self._held + text
        best, best_at = None, len(buf)
        for s in self.stop:
            at = buf.find(s, 0, best_at + len(s) - 1)
            if at != -1 and at < best_at:
                best, best_at = s, at
        if best is not None:
            self.matched = best
            self._held = ""
            return buf[: best_at + len(best) if self.include else best_at], best
        hold = self._hold_length(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """Release held-back text (the sample ended without completing a stop string)."""
        held, self._held = self._held, ""
        return held

    def _hold_length(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string."""
        tail = buf[-self._max_hold :] if self._max_hold else ""
        best = 0
        for stop in self.stop:
            # Candidate starts are where the stop's first character occurs, earliest (longest)
            # first; usually there is none and this is one str.find per stop.
            at = tail.find(stop[0])
            while at != -1 and len(tail) - at > best:
                if stop.startswith(tail[at:]):
                    best = len(tail) - at
                    break
                at = tail.find(stop[0], at + 1)
        return best


def unsent_text(
    text: str, chars: int, stop: list[str], include_stop_str_in_output: bool, matching: bool
) -> str:
    """The part of a resumed sample's ``text`` past the ``resume_text_chars`` (``chars``) its
    client already received; ``ValueError`` naming the field when that cannot be.

    ``matching``: the replica that generated ``text`` was matching stop strings (past
    ``min_tokens``), so a complete stop string in the unsent part means the sample had already
    stopped: this request is not a continuation of it.
    """
    if chars < 0:
        raise ValueError(f"resume_text_chars must be >= 0 (got {chars})")
    if chars > len(text):
        raise ValueError(
            f"resume_text_chars must be at most {len(text)}, the length of the text of "
            f"resume_token_ids (got {chars})"
        )
    unsent = text[chars:]
    if unsent and matching:
        _, matched = StopStringMatcher(stop, include_stop_str_in_output).feed(unsent)
        if matched is not None:
            raise ValueError(
                f"resume_text_chars={chars} leaves unsent text that already contains the stop "
                f"string {matched!r}"
            )
    return unsent
