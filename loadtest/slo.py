"""Service-level objectives for goodput: ``--slo ttft=500ms,tpot=50ms,e2e=10s``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from loadtest.request import RequestResult

_UNITS = {"ms": 1e-3, "s": 1.0, "": 1e-3}  # a bare number means milliseconds
SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True, slots=True)
class Slo:
    """Upper bounds in seconds; a request meets the SLO when it succeeded within every bound."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def met_by(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        for name in SLO_METRICS:
            bound = getattr(self, name)
            value = getattr(r, name)
            if bound is not None and value is not None and value > bound:
                return False
        return True

    def describe(self) -> str:
        parts = [f"{n}<={getattr(self, n) * 1e3:g}ms" for n in SLO_METRICS if getattr(self, n)]
        return ",".join(parts)


def parse_slo(text: str) -> Slo:
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\w+)\s*=\s*([0-9.]+)\s*(ms|s|)", part)
        if not m or m.group(1) not in SLO_METRICS:
            raise ValueError(
                f"bad --slo item {part!r}: expected NAME=VALUE[ms|s] with NAME in "
                f"{', '.join(SLO_METRICS)} (a bare number is milliseconds)"
            )
        values[m.group(1)] = float(m.group(2)) * _UNITS[m.group(3)]
    return Slo(**values)
