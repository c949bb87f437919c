"""The torch-free Tokenizer must agree with transformers.AutoTokenizer on the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixmesh.tokenizer import Tokenizer

TEXTS = [
    "Hello world, the cache",
    "",
    " leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "unicode: café naïve 東京 Ελληνικά",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "numbers 1234567890 3.14159 and code {json: true} <tag/> foo_bar()",
    "     ",
]

CHATS = [
    [{"role": "user", "content": "What is a prefix cache?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Explain block hashing\nin two lines."},
    ],
]


def _hf(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _assert_matches_transformers(folder: Path) -> None:
    ours, hf = Tokenizer.from_dir(folder), _hf(folder)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), text
    for chat in CHATS:
        for gen in (True, False):
            text = ours.apply_chat_template(chat, add_generation_prompt=gen)
            assert text == hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            expected = hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True)
            if isinstance(expected, dict) or hasattr(expected, "keys"):
                expected = expected["input_ids"]
            assert ours.encode_chat(chat, add_generation_prompt=gen) == list(expected)
    assert ours.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(hf)
    assert set(hf.all_special_ids) <= ours.all_special_ids


def test_tiny_matches_transformers(tiny_model_dir: Path) -> None:
    _assert_matches_transformers(tiny_model_dir)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_files) -> None:
    _assert_matches_transformers(smollm2_files.path)
    tok = Tokenizer.from_dir(smollm2_files.path)
    assert tok.eos_token_ids == frozenset({2})  # <|im_end|>
    assert tok.token_to_id("<|im_end|>") == 2
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_from_bytes_equals_from_dir(tiny_model_dir: Path) -> None:
    a = Tokenizer.from_dir(tiny_model_dir)
    b = Tokenizer.from_bytes(a.tokenizer_json, a.tokenizer_config_json, extra_eos_ids=[0])
    assert b.encode(TEXTS[4]) == a.encode(TEXTS[4])
    assert b.apply_chat_template(CHATS[1]) == a.apply_chat_template(CHATS[1])
    assert b.eos_token_ids == a.eos_token_ids | {0}
    assert a.eos_token_ids == frozenset({a.token_to_id("<|im_end|>")})


def test_chat_template_carried_in_config_bytes(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A folder that keeps its template in chat_template.jinja still ships it in the bytes."""
    import json
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "chat_template.jinja").write_text(config.pop("chat_template"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    again = Tokenizer.from_bytes(tok.tokenizer_json, tok.tokenizer_config_json)
    assert again.apply_chat_template(CHATS[0]) == Tokenizer.from_dir(
        tiny_model_dir
    ).apply_chat_template(CHATS[0])


def test_round_trip_and_special_tokens(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    text = "emoji 😀 and café"
    assert tok.decode(tok.encode(text)) == text
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end in tok.all_special_ids
    assert tok.decode(tok.encode("a<|im_end|>")) == "a"
    assert tok.decode(tok.encode("a<|im_end|>"), skip_special_tokens=False) == "a<|im_end|>"
    # The tokenizer covers exactly the model's vocabulary (no id the embedding lacks).
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    assert tok.backend.get_vocab_size() == len(tok.backend.get_vocab()) == vocab_size


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": 3, "content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], "messages[1].content"),
        (["hi"], "messages[0]"),
        ([], "messages"),
    ],
)
def test_bad_messages_raise_value_error(tiny_model_dir: Path, messages, field: str) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        tok.apply_chat_template(messages)


def test_tokenizer_module_is_torch_free() -> None:
    import subprocess
    import sys

    code = (
        "import sys, prefixmesh.tokenizer; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
