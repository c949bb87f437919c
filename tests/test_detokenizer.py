"""Incremental detokenization (whole characters, equals decode) and stop-string matching."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from prefixmesh.stop_strings import StopStringMatcher
from replica.detokenizer import IncrementalDetokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """A tiny GPT-2-style byte-level BPE (like SmolLM2's): emoji and CJK split into byte tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["hello world, the quick brown fox jumps over the lazy dog"] * 20
    corpus += ["日本語のテキスト 😀 emoji 👍🏽 café"]
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def _stream(tok: Tokenizer, prompt: list[int], out: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add(t) for t in out]
    assert detok.text == "".join(deltas)
    return deltas


def test_emoji_and_cjk_come_out_whole(tok: Tokenizer) -> None:
    prompt = tok.encode("<|im_start|>user hello<|im_end|><|im_start|>").ids
    text = " hello 😀 日本 world 👍🏽 café"
    out = tok.encode(text).ids
    # The emoji really is split over several byte-level tokens.
    assert any(tok.decode([t]).endswith("\ufffd") for t in out)
    deltas = _stream(tok, prompt, out)
    assert "".join(deltas) == text == tok.decode(out)
    assert all("\ufffd" not in d for d in deltas)
    assert " 😀" in deltas or "😀" in deltas
    assert deltas[0] == " "  # the leading space of the first token is kept


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    out = tok.encode(" hi<|im_end|> fox").ids
    assert "".join(_stream(tok, [], out, skip=True)) == " hi fox"
    assert "".join(_stream(tok, [], out, skip=False)) == " hi<|im_end|> fox"


def test_prompt_ending_mid_character_falls_back(tok: Tokenizer) -> None:
    ids = tok.encode("ab 🎉 cd").ids
    # Split inside the emoji: the prompt's tail is an incomplete character.
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    deltas = _stream(tok, ids[:cut], ids[cut:])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas).endswith(" cd")


def test_random_sequences_match_decode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    prompts = ["", "<|im_start|>assistant", "the lazy dog", "日本 😀"]
    for _ in range(300):
        prompt = tok.encode(rng.choice(prompts)).ids
        out = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        got = "".join(_stream(tok, prompt, out))
        want = tok.decode(out, skip_special_tokens=True)
        if "\ufffd" not in want:
            assert got == want
        else:  # invalid UTF-8: only replacement characters (and an unfinished tail) may differ
            got, want = got.replace("\ufffd", ""), want.replace("\ufffd", "")
            assert got == want[: len(got)]


@pytest.mark.slow
def test_smollm2_tokenizer_roundtrip(smollm2_files) -> None:
    from prefixmesh.tokenizer import Tokenizer as PrefixmeshTokenizer

    tok = PrefixmeshTokenizer.from_dir(smollm2_files.path)
    prompt = tok.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    text = " Hello there! 😀 日本語 naïve café — done.\n\nBye"
    out = tok.encode(text, add_special_tokens=False)
    assert len(out) > len(text.split())  # multibyte characters span several tokens
    deltas = _stream(tok, prompt, out)
    assert "".join(deltas) == tok.decode(out) == text
    assert all("\ufffd" not in d for d in deltas)
    eos = sorted(tok.eos_token_ids)[0]
    assert "".join(_stream(tok, prompt, out + [eos])) == text  # special tokens skipped


# -- stop strings -------------------------------------------------------------------------------


def _run(m: StopStringMatcher, deltas: list[str]) -> tuple[str, str | None]:
    emitted = []
    for d in deltas:
        text, stop = m.feed(d)
        emitted.append(text)
        if stop is not None:
            return "".join(emitted), stop
    return "".join(emitted) + m.flush(), None


def test_no_stop_strings_pass_through() -> None:
    m = StopStringMatcher([], False)
    assert m.feed("abc") == ("abc", None)
    assert m.flush() == ""


def test_stop_split_across_three_deltas_is_never_emitted() -> None:
    m = StopStringMatcher(["STOP"], False)
    assert m.feed("hello S") == ("hello ", None)
    assert m.feed("T") == ("", None)
    assert m.feed("OP and more") == ("", "STOP")
    assert m.feed("later") == ("", None)  # done after a match


def test_stop_at_the_very_start() -> None:
    assert _run(StopStringMatcher(["\n\n"], False), ["\n", "\nrest"]) == ("", "\n\n")
    assert _run(StopStringMatcher(["ab"], False), ["abc"]) == ("", "ab")


def test_include_stop_str_in_output() -> None:
    assert _run(StopStringMatcher(["END"], True), ["x E", "N", "Dyz"]) == ("x END", "END")


def test_false_start_is_released() -> None:
    m = StopStringMatcher(["STOP"], False)
    assert m.feed("a ST") == ("a ", None)
    assert m.feed("ART") == ("START", None)


def test_flush_returns_held_text() -> None:
    m = StopStringMatcher(["</answer>"], False)
    assert m.feed("42 </ans") == ("42 ", None)
    assert m.flush() == "</ans"
    assert m.flush() == ""


def test_earliest_stop_wins() -> None:
    m = StopStringMatcher(["world", "lo w"], False)
    assert m.feed("hello world") == ("hel", "lo w")


def test_matches_a_search_of_the_accumulated_text() -> None:
    """Random stops and random splits against a plain search after every delta."""
    rng = random.Random(1)
    for _ in range(2000):
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abcd", k=rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        include = rng.random() < 0.5
        want: tuple[str, str | None] = (text, None)
        acc = ""
        for d in deltas:
            acc += d
            hits = [(acc.find(s), i, s) for i, s in enumerate(stops) if s in acc]
            if hits:
                at, _, s = min(hits)
                want = (acc[: at + len(s)] if include else acc[:at], s)
                break
        assert _run(StopStringMatcher(stops, include), deltas) == want, (stops, deltas)
