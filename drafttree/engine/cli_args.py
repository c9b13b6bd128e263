"""Command-line flags made from EngineConfig's fields, and the EngineConfig back from parsed flags.

A field's flag is `--` and its name with dashes (or its metadata's `flags`), its help its
metadata's `help`. Switches (bool fields) take `--x` and `--no-x`; others take one value, parsed by
the metadata's `type` or the field's own (int, float, str). A flag not given leaves its field at
the default (EngineConfig's, or the command's own where it passes one), so only what the user set
differs from it."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, Field, fields
from typing import Any

from drafttree.engine.config import EngineConfig

# Fields the serving commands (generate, serve, graphs) have no flag for: timing-only models (random
# weights have no tokenizer to serve text with); the benchmarks take them.
NOT_SERVED: tuple[str, ...] = tuple(f.name for f in fields(EngineConfig) if f.metadata.get("timing_only"))

_SCALARS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def field_names(exclude: Iterable[str] = ()) -> list[str]:
    """EngineConfig's field names, in order, less `exclude` (each must be a field)."""
    names = [f.name for f in fields(EngineConfig)]
    _check_known(exclude)
    return [n for n in names if n not in set(exclude)]


def serving_fields() -> list[str]:
    """The fields `drafttree generate`, `serve` and `graphs` take: all but NOT_SERVED."""
    return field_names(NOT_SERVED)


def flags_of(name: str) -> tuple[str, ...]:
    """The option strings of a field's flag (a switch's `--no-` form not included)."""
    f = _field(name)
    return tuple(f.metadata.get("flags", ("--" + f.name.replace("_", "-"),)))


def add_engine_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, names: Iterable[str],
                    defaults: Mapping[str, Any] | None = None, notes: Mapping[str, str] | None = None,
                    default_texts: Mapping[str, str] | None = None) -> None:
    """Add the flags of EngineConfig's fields `names` to `parser` (or an argument group), each
    parsed into the attribute of the field's name; `defaults` replaces EngineConfig's default of
    a field on this command (its help then shows it), `notes` adds to a field's help what it
    means on this command, `default_texts` says in words what an unset field means on it."""
    names = list(names)
    defaults, notes, texts = dict(defaults or {}), dict(notes or {}), dict(default_texts or {})
    _check_known(names)
    stray = (set(defaults) | set(notes) | set(texts)) - set(names)
    if stray:
        raise ValueError(f"defaults or notes for fields without a flag here: {sorted(stray)}")
    for name in names:
        f = _field(name)
        default = defaults.get(name, _default(f))
        kw: dict[str, Any] = {"dest": f.name, "default": default,
                              "help": _help(f, default, name in defaults, notes.get(name), texts.get(name))}
        parse = _parser_of(f)
        if parse is None:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _typed(parse)
            for key in ("choices", "metavar"):
                if key in f.metadata:
                    kw[key] = f.metadata[key]
        parser.add_argument(*flags_of(name), **kw)


def config_from_args(ns: argparse.Namespace, **fixed: Any) -> EngineConfig:
    """The EngineConfig of the engine flags parsed into `ns` (every attribute named as a field:
    those `add_engine_args` added), with the fields in `fixed` set over them."""
    _check_known(fixed)
    values = {f.name: getattr(ns, f.name) for f in fields(EngineConfig) if hasattr(ns, f.name)}
    values.update(fixed)
    return EngineConfig(**values)


def _field(name: str) -> Field:
    for f in fields(EngineConfig):
        if f.name == name:
            return f
    raise ValueError(f"EngineConfig has no field {name!r}")


def _check_known(names: Iterable[str]) -> None:
    known = {f.name for f in fields(EngineConfig)}
    bad = sorted(set(names) - known)
    if bad:
        raise ValueError(f"EngineConfig has no field {bad}")


def _default(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]


def _parser_of(f: Field) -> Callable[[str], Any] | None:
    """How a field's flag parses its value: the metadata's `type`, else by the field's type less
    `| None` (int, float, str); None for a switch (bool)."""
    if "type" in f.metadata:
        return f.metadata["type"]
    parts = [p.strip() for p in str(f.type).split("|") if p.strip() != "None"]
    if parts == ["bool"]:
        return None
    if len(parts) != 1 or parts[0] not in _SCALARS:
        raise ValueError(f"EngineConfig.{f.name}: type {f.type} needs a `type` in its metadata to parse a flag")
    return _SCALARS[parts[0]]


def _help(f: Field, default: Any, overridden: bool, note: str | None, default_text: str | None = None) -> str:
    """The metadata's help, the command's note and the default: the command's own words for it,
    its own value, else the field's default in words (`default_text`) or, for a set value, the
    value (a switch's as on/off)."""
    text = f.metadata.get("help", "").strip()
    if not text:
        raise ValueError(f"EngineConfig.{f.name} has no help text in its metadata")
    if note:
        text += f"; {note}"
    if default_text is not None:
        shown = default_text
    elif not overridden and "default_text" in f.metadata:
        shown = f.metadata["default_text"]
    elif isinstance(default, bool):
        shown = "on" if default else "off"
    elif default is None:
        raise ValueError(f"EngineConfig.{f.name}: say what its default None means (metadata default_text)")
    else:
        shown = str(default)
    return f"{text} (default: {shown})".replace("%", "%%")   # argparse formats help with %


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` with its ValueError's message as argparse's error ('argument --x: <message>')."""
    def run(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            if parse in _SCALARS.values():
                raise argparse.ArgumentTypeError(f"expected {parse.__name__}, got {text!r}") from None
            raise argparse.ArgumentTypeError(str(e)) from None
    run.__name__ = getattr(parse, "__name__", "value")
    return run
