"""Run a process's main coroutine on uvloop where it is installed, else on asyncio's own loop.

uvloop lowers the per-request cost of every server and of the load tester's client; it has no
Windows build, where the default loop works, only slower. One place for that choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop when it can be imported."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
