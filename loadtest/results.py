"""Writing results: per-request JSONL and the summary JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtest.request import RequestResult


def write_requests(results: list[RequestResult], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in results:
            f.write(json.dumps(r.to_json()) + "\n")


def read_requests(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_summary(summary: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
