"""Strict recipe loading: YAML -> typed `Recipe`, with `--set` overrides.

Precedence is dataclass defaults < the YAML file < `--set key.path=value` (command-line flags such as
`--np` are turned into `--set` entries by the CLI). Every problem becomes a `RecipeError` whose message
names the full key path and what to change, so the CLI can print it and exit 2 before anything starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from launcher.config import Recipe
from lms_core.config import SettingError, settings_of


class RecipeError(Exception):
    """A recipe (or an override) cannot be used. The message is meant for the user as it is."""


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Reads the YAML recipe at `path`, applies `overrides` (`key.path=value`), validates everything."""
    raw = read_yaml(path)
    for item in overrides:
        key, value = parse_override(item)
        set_path(raw, key, value)
    model = raw.get("model")
    if isinstance(model, dict) and model.get("builder") is not None and model.get("builder_dir") is None:
        model["builder_dir"] = str(Path(path).resolve().parent)  # your module sits beside your recipe
    recipe = recipe_from_dict(raw, source=str(path))
    if recipe.model.builder is not None:
        check_builder(recipe, source=str(path))
    return recipe


def check_builder(recipe: Recipe, source: str) -> None:
    """Imports `model.builder`'s module and checks its function and `model.options` now, so that a
    missing module, function or option fails before anything starts. (That imports TensorFlow, as
    the user's module does; the built-in models' recipes load without it.)"""
    from launcher.rank.tasks.builder import BuilderError, resolve_builder

    try:
        resolve_builder(recipe.model)
    except BuilderError as err:
        raise RecipeError(f"{source}: {err}") from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise RecipeError(f"{where}: YAML syntax error: {err.problem or err}") from None
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: YAML syntax error: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections (model, data, train, ...), got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """`train.batch_size=64` -> ("train.batch_size", 64). Values are YAML, so 64, true, [1, 2] work."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {item!r}: expected key.path=value, e.g. --set train.batch_size=64")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text  # not YAML: take it as a plain string
    return key.strip(), value


def set_path(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"--set {key}: {'.'.join(parts[:depth + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def recipe_from_dict(raw: dict[str, Any], source: str = "recipe") -> Recipe:
    try:
        return _build(Recipe, raw, prefix="")
    except SettingError as err:  # a cross-section check in Recipe.__post_init__ names its full key
        raise RecipeError(f"{source}: {err.key}: {err.rule}") from None
    except RecipeError as err:
        raise RecipeError(f"{source}: {err}") from None


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as it would be written (the resolved recipe.yaml): what it says, not what was
    parsed from it, so the dict loads back into the same recipe."""
    return settings_of(recipe)


def _build(cls: type, raw: Any, prefix: str) -> Any:
    """Builds dataclass `cls` from `raw`, checking every key and type; `prefix` is its key path."""
    where = prefix.rstrip(".") or "the recipe"
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: expected a mapping of keys, got {_describe(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # the others are parsed from these
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            raise RecipeError(_unknown_key(prefix, str(key), list(fields)))
        kwargs[key] = _convert(hints[key], value, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except SettingError as err:
        if cls is Recipe:
            raise
        raise RecipeError(f"{prefix}{err.key}: {err.rule}") from None


def _unknown_key(prefix: str, key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    return f"unknown key '{prefix}{key}'{hint} (valid keys here: {', '.join(valid)})"


def _convert(hint: Any, value: Any, key: str) -> Any:
    """Checks `value` against the annotation `hint`; ints are accepted where floats are expected."""
    if dataclasses.is_dataclass(hint):
        return _build(hint, {} if value is None else value, prefix=f"{key}.")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        choices = [a for a in args if a is not type(None)]
        for inner in choices[:-1]:  # e.g. `float | str`: a number if it is one, else a name
            try:
                return _convert(inner, value, key)
            except RecipeError:
                pass
        return _convert(choices[-1], value, key)
    if origin is dict:  # a free mapping (model.options): YAML values, keys checked by their reader
        if not isinstance(value, dict):
            raise RecipeError(f"{key}: expected a mapping of keys, got {_describe(value)}")
        return dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{key}: expected a list, got {_describe(value)}")
        return [_convert(args[0], item, f"{key}[{i}]") for i, item in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{key}: expected true or false, got {_describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{key}: expected an integer, got {_describe(value)}")
        return value
    if hint is float:
        if isinstance(value, str):
            # PyYAML follows YAML 1.1, which reads 1e-3 (no dot) as a string: take it as the number meant.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{key}: expected a number, got {_describe(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise RecipeError(f"{key}: expected a string, got {_describe(value)}")
        return value
    raise TypeError(f"{key}: unsupported annotation {hint!r} in the recipe schema")


def _describe(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"
