"""Click options derived from EngineArgs' fields: each engine setting is declared once
(runtime/engine/engine_args.py) and `trtserve serve` / `generate` offer it with the same name, help and bounds."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import click

from runtime.engine.engine_args import EngineArgs


def engine_options(settings: Sequence[dataclasses.Field[Any]]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Options for `settings` (EngineArgs fields); the command gets them as one `engine_args` argument, an
    EngineArgs of the options given (the others at their defaults). A bad combination is a usage error."""
    names = [f.name for f in settings]

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            given = {name: _joined(value) for name in names if (value := kwargs.pop(name)) not in (None, ())}
            _check_needs(settings, given)
            try:
                engine_args = EngineArgs(**given)
            except ValueError as exc:
                raise click.UsageError(_in_option_words(str(exc))) from None
            return command(*args, engine_args=engine_args, **kwargs)

        decorated: Callable[..., Any] = run
        for setting in reversed(settings):
            decorated = _option(setting)(decorated)
        return decorated

    return decorate


def _check_needs(settings: Sequence[dataclasses.Field[Any]], given: dict[str, Any]) -> None:
    """A usage error for an option given without the setting it means something with (its `only_with`)."""
    flags = {f.name: flag_of(f) for f in dataclasses.fields(EngineArgs)}
    for setting in settings:
        need = setting.metadata.get("only_with")
        if need is None or setting.name not in given:
            continue
        name, _, value = need.partition("=")
        if given.get(name) is None or (value and given[name] != value):
            raise click.UsageError(
                f"{flags[setting.name]} is only used with {flags[name]}{' ' + value if value else ''}"
            )


def flag_of(setting: dataclasses.Field[Any]) -> str:
    """The option's name (a bool's first form): --max-num-seqs, --prefix-caching, ..."""
    flag = setting.metadata.get("flag") or f"--{setting.name.replace('_', '-')}"
    return str(flag).split("/")[0]


def _option(setting: dataclasses.Field[Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    meta, kind = setting.metadata, str(setting.type)
    flag = meta.get("flag") or f"--{setting.name.replace('_', '-')}"
    default = setting.default
    shown = "none" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
    need = meta.get("only_with")
    only = f" (with --{need.replace('=', ' ')})" if need else ""
    help_text = f"{meta['help']}{only}  [default: {shown}]"
    if kind.startswith("bool"):
        return click.option(flag, setting.name, default=None, help=help_text)
    if meta.get("choices"):
        kind_type: click.ParamType = click.Choice(meta["choices"])
    elif kind.startswith("int"):
        kind_type = click.IntRange(min=meta.get("lo"), max=meta.get("hi"))
    elif kind.startswith("float"):
        kind_type = click.FloatRange(min=meta.get("lo"), max=meta.get("hi"))
    else:
        kind_type = click.STRING
    if meta.get("repeat"):
        return click.option(flag, setting.name, type=kind_type, multiple=True, help=help_text)
    return click.option(flag, setting.name, type=kind_type, default=None, help=help_text)


def _joined(value: Any) -> Any:
    """A repeated option's values as one text setting (EngineArgs takes them comma-separated)."""
    return ",".join(value) if isinstance(value, tuple) else value


def _in_option_words(message: str) -> str:
    """EngineArgs' error with its field names written as their options (--draft-engine for draft_engine)."""
    for setting in sorted(dataclasses.fields(EngineArgs), key=lambda f: -len(f.name)):
        message = message.replace(f"EngineArgs.{setting.name}", flag_of(setting))
    return message
