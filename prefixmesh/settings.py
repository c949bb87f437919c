"""Typed process configuration from CLI flags and same-named environment variables.

One frozen dataclass per process (``ServerConfig``, ``RouterConfig``); every field becomes a
flag ``--field-name`` whose default is the environment variable ``PREFIXMESH_FIELD_NAME`` when
set, else the dataclass default, so ``--help`` documents every knob with its effective default.
A flag given on the command line wins over the environment. Torch-free.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from typing import Any

ENV_PREFIX = "PREFIXMESH_"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def build_parser(
    config_cls: Any,
    help_texts: dict[str, str],
    prog: str,
    description: str,
    secret_fields: tuple[str, ...] = (),
) -> argparse.ArgumentParser:
    """An argument parser with one flag per field of the dataclass ``config_cls``.

    ``secret_fields`` (an API key, say) take their environment value without ever showing it
    in ``--help``.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"{description} Every flag can also be set by the environment variable "
        f"{ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT); a flag wins.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = config_cls()
    for f in fields(config_cls):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        env = os.environ.get(env_name(f.name))
        help_ = f"{help_texts[f.name]} [env {env_name(f.name)}]"
        if f.name in secret_fields:
            help_ += " (value not shown)"
        kind = type(default)
        try:
            if isinstance(default, bool):
                value = parse_bool(env) if env is not None else default
            else:
                value = kind(env) if env is not None else default
        except ValueError as exc:
            parser.error(f"{env_name(f.name)}={env!r}: {exc}")
        if isinstance(default, bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=value, help=help_
            )
        elif f.name in secret_fields:
            # A suppressed default keeps the value out of --help; parse() fills it in.
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_)
        else:
            parser.add_argument(flag, type=kind, default=value, help=help_)
    return parser


def parse(config_cls: Any, parser: argparse.ArgumentParser, argv: list[str] | None) -> Any:
    """``config_cls`` built from ``argv`` and the environment (see ``build_parser``)."""
    values = vars(parser.parse_args(argv))
    defaults = config_cls()
    for f in fields(config_cls):
        if f.name not in values:  # a secret not given on the command line
            values[f.name] = os.environ.get(env_name(f.name), getattr(defaults, f.name))
    return config_cls(**values)
