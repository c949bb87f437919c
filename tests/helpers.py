"""The test harness: real Redis and real processes on 127.0.0.1, and a tiny model.

Built on what ``prefixmesh up`` itself runs: Redis is ``prefixmesh.redis_server``'s
``EmbeddedRedis``, and every child process (``Proc``) is started and stopped by
``prefixmesh.procs``' ``Supervisor``: its own process group, no orphan left behind if
pytest dies, SIGTERM then SIGKILL after a grace period, its output kept for failure messages.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from prefixmesh.ports import free_port
from prefixmesh.procs import LogSink, ProcessSpec, Supervisor, wait_serving
from prefixmesh.redis_server import EmbeddedRedis

__all__ = [
    "CLI", "EmbeddedRedis", "Proc", "free_port", "start_redis", "stop_all", "wait_until",
]  # fmt: skip

ROOT = Path(__file__).resolve().parent.parent
CLI = (sys.executable, "-m", "prefixmesh.cli")  # this interpreter, this tree's code


def start_redis(port: int | None = None) -> EmbeddedRedis:
    """Start a real redis-server on ``port`` (a free one by default) and wait until it answers."""
    return EmbeddedRedis(port=port or 0).start()


@dataclass
class _TailSink(LogSink):
    """Keeps the last lines each child wrote, for failure messages (nothing is printed)."""

    tails: dict[str, collections.deque[str]] = field(default_factory=dict)

    def line(self, name: str, text: str) -> None:
        with self._lock:
            self.tails.setdefault(name, collections.deque(maxlen=400)).append(text.rstrip())


class Proc:
    """One child process of a test (a ``prefixmesh`` command with ``Proc.cli``).

    ``env`` goes on top of the test's environment (or, with ``inherit_env=False``, is all of
    it); ``PYTHONPATH`` is this tree, so children import the code under test. ``stop`` sends
    SIGTERM and waits ``grace_s`` before SIGKILL.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        grace_s: float = 15.0,
        inherit_env: bool = True,
    ) -> None:
        self.name = name
        self._sink = _TailSink()
        self._sup = Supervisor(self._sink, grace_s=grace_s)
        path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
        env = {"PYTHONPATH": path, **(env or {})}
        spec = ProcessSpec(name, list(argv), env, inherit_env=inherit_env)
        self.proc: subprocess.Popen[bytes] = self._sup.start(spec).proc

    @classmethod
    def cli(cls, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        """``prefixmesh <args>`` run by this interpreter."""
        return cls(name, [*CLI, *args], env)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def logs(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of the child's output."""
        return "\n".join(self._sink.tails.get(self.name, ()))[-chars:]

    def wait_serving(self, address: str, timeout: float = 180.0) -> None:
        """Until gRPC health on ``address`` says SERVING; fails with the child's output."""
        try:
            wait_serving(address, timeout, alive=self.alive)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{self.name}: {exc}\n{self.logs()}") from exc

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the child (and anything it started in its group); SIGKILL stops it at once."""
        if sig == signal.SIGKILL:
            self._sup.grace_s = 0.0
        self._sup.shutdown()
        if os.environ.get("PM_KEEP_LOGS"):
            print(f"--- {self.name} ---\n{self.logs(100_000)}")


def run_under_cap(script: str, args: Sequence[str], cap: str, cwd: Path) -> dict:
    """Run ``python -c script *args`` in a fresh process with the ISA capped to ``cap`` (our
    flags and oneDNN's and ATen's own, ``cpu_flags.torch_env``) and return the JSON it prints
    after ``RESULT``."""
    from kernels import cpu_flags

    env = {**os.environ, **cpu_flags.torch_env(cap)}
    run = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def wait_until(
    procs: Sequence[Proc], ready: Callable[[], bool], what: str, timeout: float = 180.0
) -> None:
    """Poll ``ready()`` (connection errors count as not ready) until it holds; fail with the
    processes' output when one of them exits or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p for p in procs if not p.alive()]
        assert not dead, f"{dead[0].name} exited:\n{dead[0].logs()}"
        try:
            if ready():
                return
        except (OSError, grpc.RpcError):
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what} not ready:\n" + "\n".join(p.logs() for p in procs))


def stop_all(procs: Sequence[Proc]) -> None:
    """Stop every process, the last started first."""
    for proc in reversed(procs):
        proc.stop()


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


def pair_modes() -> list[str]:
    """The pair GEMM's paths this machine runs (``PREFIXMESH_BF16_GEMM`` values): the plain C++
    emulation everywhere the kernels build, the vdpbf16ps one where the CPU has it."""
    from kernels import cpu_ops

    ops = cpu_ops.load()
    if ops is None:
        return []
    return ["emulated", "pairs"] if ops.pairs_hardware() else ["emulated"]


def blocks_held_by(src, dst, ids: list[int], salt: str | None = None):
    """The blocks of prompt ``ids`` that engine ``src`` holds, as engine ``dst`` would receive
    them from a peer (``FetchedBlocks``: pinned, read and unpinned as the servers do)."""
    # Imported here, as make_tiny_model_dir does: the process tests' helpers need no torch.
    from prefixmesh.hashing import block_hashes
    from replica.fetch.transfer import FetchedBlocks, layer_tensor, read_blocks

    bs = src.block_manager.block_size
    pinned = src.pin_prefix(block_hashes(ids, bs, src.model_id, salt), salt)
    try:
        data = read_blocks(src.runner.kv_caches, pinned.blocks)
    finally:
        src.unpin(pinned.pin_id)
    mc = dst.model_config
    shape = (bs, mc.num_kv_heads, mc.head_dim)
    layers = range(mc.num_layers)
    return FetchedBlocks(
        pinned.hashes, pinned.token_ids,
        [layer_tensor([keys[i] for keys, _ in data], dst.dtype, shape) for i in layers],
        [layer_tensor([vals[i] for _, vals in data], dst.dtype, shape) for i in layers],
    )  # fmt: skip
