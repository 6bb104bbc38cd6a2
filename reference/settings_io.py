"""Settings from a config file and ``--set key=value``, strictly typed (SPEC 10, "Configurable
without editing code").

Every field of ``DQNConfig`` (section ``config``) and of ``LoopSettings`` (section ``loop``) is a
setting; the list is ``dataclasses.fields`` of the two, so a new field is configurable without
touching this module. A key is the field's name (``lr``, ``epochs``), or ``config.<name>`` /
``loop.<name>`` (needed only if a name is in both sections). Unknown keys are rejected with
the nearest known ones.

Types come from the fields' annotations and are checked strictly before the dataclasses'
own range checks:

================================  ===========================  ===============================
field type                        in a TOML / JSON file        in ``--set``
================================  ===========================  ===============================
``int``                           an integer (not 3.0, true)   ``-?[0-9]+``
``float``                         a number (not "0.9", true)   anything ``float()`` reads
``str``                           a string                     the text as is
``bool``                          true / false                 ``true`` / ``false``
``tuple[T, ...]``                 an array of T                ``a,b,c`` (each read as T)
``A | B``                         the first of A, B that fits  the first of A, B that fits
================================  ===========================  ===============================

A config file (``.toml`` or ``.json``) is a table whose keys are setting keys, the tables
``config`` and ``loop`` (holding that section's field names), or ``preset`` (a preset name)::

    preset = "tiny"
    lr = 3e-4
    [loop]
    epochs = 5
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .config import PRESETS, DQNConfig
from .loop import LoopSettings

#: The two sections of settings and the dataclass behind each.
SECTIONS: dict[str, type] = {"config": DQNConfig, "loop": LoopSettings}
#: Top-level config-file keys that are not settings.
FILE_KEYS = ("preset",)
_INT_TEXT = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True)
class Setting:
    """One configurable field: its section, name and resolved annotation."""

    section: str
    name: str
    type: Any

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


def all_settings() -> dict[str, Setting]:
    """Every setting by its qualified key ``section.name``, in section and field order."""
    out = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out[f"{section}.{f.name}"] = Setting(section, f.name, hints[f.name])
    return out


def resolve(key: str) -> Setting:
    """The setting a key names (``lr``, ``loop.epochs``); ``ValueError`` naming the key and the
    nearest known keys if it names none, or both sections' fields if it is ambiguous."""
    table = all_settings()
    if key in table:
        return table[key]
    matches = [s for s in table.values() if s.name == key]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ValueError(f"setting {key!r} is ambiguous: write one of "
                         f"{', '.join(s.key for s in matches)}")
    section, dot, name = key.rpartition(".")
    if dot and any(s.name == name for s in table.values()):
        others = ", ".join(s.key for s in table.values() if s.name == name)
        raise ValueError(f"unknown setting {key!r}: {name} is {others}")
    names = list(table) if dot else [s.name for s in table.values()]
    near = difflib.get_close_matches(key, names, n=3, cutoff=0.0)
    raise ValueError(f"unknown setting {key!r}; nearest known: {', '.join(near)} "
                     "(foxhunt train --help lists them all)")


def describe_type(tp: Any) -> str:
    """How a value of annotation ``tp`` is written, for error messages."""
    if _is_union(tp):
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        inner = describe_type(args[0]) if args else "value"
        n = "" if len(args) == 2 and args[1] is Ellipsis else f"{len(args)} "
        return f"a list of {n}{inner.removeprefix('an ').removeprefix('a ')}s (--set: a,b,c)"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def coerce(tp: Any, value: Any, *, text: bool) -> Any:
    """``value`` as a value of annotation ``tp``; ``text=True`` reads it from ``--set`` text.
    Raises ``TypeError`` (without a message: the caller names the key) if it does not fit."""
    if _is_union(tp):
        for arg in typing.get_args(tp):
            try:
                return coerce(arg, value, text=text)
            except TypeError:
                continue
        raise TypeError
    if tp is type(None):
        if (text and value.strip().lower() == "none") or (not text and value is None):
            return None
        raise TypeError
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        items = value.split(",") if text else value
        if not isinstance(items, (list, tuple)):
            raise TypeError
        homogeneous = len(args) == 2 and args[1] is Ellipsis
        if not homogeneous and len(items) != len(args):
            raise TypeError
        kinds = [args[0]] * len(items) if homogeneous else list(args)
        return tuple(coerce(k, v, text=text) for k, v in zip(kinds, items))
    if tp is bool:
        if text and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if not text and isinstance(value, bool):
            return value
        raise TypeError
    if tp is int:
        if text and _INT_TEXT.fullmatch(value.strip()):
            return int(value)
        if not text and isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if tp is float:
        if text:
            try:
                return float(value)
            except ValueError:
                raise TypeError from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise TypeError
    if tp is str:
        if text or isinstance(value, str):
            return value
        raise TypeError
    raise TypeError


def typed_value(setting: Setting, value: Any, *, text: bool, origin: str) -> Any:
    """``coerce`` with a one-line ``ValueError`` naming the origin, key, value and type."""
    try:
        return coerce(setting.type, value, text=text)
    except TypeError:
        shown = value if text else json.dumps(value, default=str)
        raise ValueError(f"{origin}: {setting.name}={shown}: expected "
                         f"{describe_type(setting.type)}") from None


def parse_set(items: list[str]) -> list[tuple[Setting, Any]]:
    """``--set key=value`` items, in order, as (setting, typed value)."""
    out = []
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected key=value, e.g. --set lr=3e-4")
        try:
            setting = resolve(key.strip())
        except ValueError as exc:
            raise ValueError(f"--set {item}: {exc}") from None
        out.append((setting, typed_value(setting, text.strip(), text=True, origin="--set")))
    return out


@dataclass(frozen=True)
class ConfigFile:
    preset: str | None
    values: list[tuple[Setting, Any]]


def read_config_file(path: Path) -> ConfigFile:
    """Read a ``.toml`` or ``.json`` config file (see the module docstring)."""
    path = Path(path)
    kind = path.suffix.lower()
    if kind not in (".toml", ".json"):
        raise ValueError(f"--config {path}: the name must end in .toml or .json")
    try:
        raw_bytes = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it: {exc.strerror}") from None
    try:
        if kind == ".toml":
            import tomllib

            data = tomllib.loads(raw_bytes.decode("utf-8-sig"))
        else:
            data = json.loads(raw_bytes.decode("utf-8-sig"))
    except (ValueError, UnicodeDecodeError) as exc:  # TOMLDecodeError, JSONDecodeError
        raise ValueError(f"--config {path}: not valid {kind[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the top level must be a table of settings")
    origin = f"--config {path}"
    preset = None
    values: list[tuple[Setting, Any]] = []
    for key, value in data.items():
        if key == "preset":
            if value not in PRESETS:
                raise ValueError(f"{origin}: preset={value!r}: allowed values are {tuple(PRESETS)}")
            preset = value
        elif key in SECTIONS and isinstance(value, dict):
            for name, v in value.items():
                setting = all_settings().get(f"{key}.{name}")
                if setting is None:
                    try:
                        other = resolve(name).key
                    except ValueError as exc:
                        raise ValueError(f"{origin}: [{key}] {exc}") from None
                    raise ValueError(f"{origin}: [{key}] {name!r} is not a {key} setting; it is "
                                     f"{other}")
                values.append((setting, typed_value(setting, v, text=False, origin=origin)))
        else:
            try:
                setting = resolve(key)
            except ValueError as exc:
                raise ValueError(f"{origin}: {exc}") from None
            values.append((setting, typed_value(setting, value, text=False, origin=origin)))
    return ConfigFile(preset, values)


def build(preset: str, layers: list[list[tuple[Setting, Any]]]) -> tuple[DQNConfig, LoopSettings]:
    """``DQNConfig.preset(preset)`` and ``LoopSettings()`` with each layer of (setting, value)
    applied in order (a later layer wins); validated by the dataclasses."""
    kw: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for layer in layers:
        for setting, value in layer:
            kw[setting.section][setting.name] = value
    return DQNConfig.preset(preset, **kw["config"]), LoopSettings(**kw["loop"])


def section_from_dict(section: str, data: Mapping[str, Any], origin: str):
    """Rebuild one section's dataclass from a JSON mapping (e.g. a run's ``config.json``)."""
    cls = SECTIONS[section]
    kw = {}
    for name, value in data.items():
        setting = all_settings().get(f"{section}.{name}")
        if setting is None:
            raise ValueError(f"{origin}: unknown {section} setting {name!r}")
        kw[name] = typed_value(setting, value, text=False, origin=origin)
    return cls(**kw)


def settings_help() -> str:
    """Every setting with its default (the ``seed`` preset's for ``config``), for ``--help``."""
    defaults = {"config": DQNConfig.preset("seed"), "loop": LoopSettings()}
    lines = []
    for section, obj in defaults.items():
        parts = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
            parts.append(f"{f.name}={shown}")
        lines.append(textwrap.fill(" ".join(parts), width=92, initial_indent=f"  {section}: ",
                                   subsequent_indent="    ", break_on_hyphens=False))
    return "\n".join(lines)
