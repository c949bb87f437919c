"""``prefixmesh bench startup``: ``LLM(model)`` in a fresh process, import to first token."""

from __future__ import annotations

import subprocess
import sys

HELP = "start-up: a fresh process's import to first token"


def add_arguments(parser) -> None:
    pass


def run(args) -> dict:
    code = (
        "import time; t=time.perf_counter(); from replica import LLM, SamplingParams; "
        f"llm=LLM({args.model!r}, dtype={args.dtype!r}); "
        "llm.generate(['Hello'], SamplingParams(max_tokens=1)); print(time.perf_counter()-t)"
    )
    took = float(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    print(f"LLM({args.model!r}) in a fresh process, import to first token: {took:.1f} s")
    return {"startup_to_first_token_s": took}
