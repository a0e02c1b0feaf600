"""Command-line flags generated from configuration dataclasses: one field, one flag, one default.

A field ``pipeline_model_parallel_size: int = 1`` becomes ``--pipeline-model-parallel-size``
(Megatron's spelling; a field's ``metadata={"flag": ...}`` overrides it) with the field's
default and, as help, the docstring written under the field. Types decide the rest: ``bool``
fields are switches (``--x`` / ``--no-x`` when the default is True), ``Literal`` fields take
one of their values, ``X | None`` fields default to None, fixed-length tuples take that many
values and lists one or more. Each dataclass is one ``--help`` group.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

__all__ = ["add_config_flags", "config_from_args", "field_docs", "flag_of"]

T = TypeVar("T")


def flag_of(field: dataclasses.Field[Any]) -> str:
    """The flag of a configuration field (``--`` and the name with dashes, unless overridden)."""
    flag = field.metadata.get("flag")
    return str(flag) if flag is not None else "--" + field.name.replace("_", "-")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, by field name (one line each)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
        for statement, following in itertools.pairwise(body):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _without_none(hint: Any) -> tuple[Any, bool]:
    """The type inside ``X | None`` and whether None was allowed."""
    if get_origin(hint) in (Union, types.UnionType):
        members = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(members) == 1 and len(get_args(hint)) == 2:
            return members[0], True
    return hint, False


def _argument_options(field: dataclasses.Field[Any], hint: Any) -> dict[str, Any]:
    """Argparse keywords for one field: type, choices, nargs or a switch action."""
    inner, _ = _without_none(hint)
    origin = get_origin(inner)
    default = field.default
    if inner is bool:
        return {"action": argparse.BooleanOptionalAction if default else "store_true"}
    if origin is Literal:
        values = get_args(inner)
        return {"choices": list(values), "type": type(values[0])}
    if origin is tuple:
        members = get_args(inner)
        return {"nargs": len(members), "type": members[0]}
    if origin is list:
        return {"nargs": "+", "type": get_args(inner)[0]}
    if inner in (int, float, str):
        return {"type": inner}
    raise TypeError(f"field {field.name!r} has type {hint!r}, which no flag can take")


def add_config_flags(
    parser: argparse.ArgumentParser, classes: Iterable[type], *, skip: Iterable[str] = ()
) -> None:
    """Adds one flag per field of each configuration dataclass, one help group per class.

    Args:
        parser: The parser to extend.
        classes: Frozen configuration dataclasses; a class's first docstring line titles its
            group.
        skip: Field names that get no flag (set by the program, not the user).

    Raises:
        TypeError: A class is not a dataclass, or a field's type cannot be a flag.
        ValueError: Two fields would share a flag.
    """
    skipped = set(skip)
    for cls in classes:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        title = (inspect.getdoc(cls) or cls.__name__).splitlines()[0].rstrip(".")
        group = parser.add_argument_group(title)
        hints, docs = get_type_hints(cls), field_docs(cls)
        for field in dataclasses.fields(cls):
            if field.name in skipped or not field.init:
                continue
            flag = flag_of(field)
            if flag in parser._option_string_actions:
                raise ValueError(f"{cls.__name__}.{field.name}: flag {flag} is taken already")
            extra = {"metavar": field.metadata["metavar"]} if "metavar" in field.metadata else {}
            group.add_argument(
                flag,
                dest=field.name,
                **extra,
                default=field.default,
                # argparse fills %(default)s at --help time, so a program's set_defaults shows.
                help=docs.get(field.name, "").replace("%", "%%") + " (default: %(default)s)",
                **_argument_options(field, hints[field.name]),
            )


def config_from_args(
    cls: type[T], args: argparse.Namespace, extra: Mapping[str, Any] | None = None
) -> T:
    """An instance of configuration dataclass `cls` from parsed flags (its own validation runs).

    Args:
        cls: The dataclass.
        args: Parsed flags (one attribute per field, as `add_config_flags` made them).
        extra: Values for fields that have no flag.

    Raises:
        ValueError: The class's validation refused a value (its message names it).
    """
    hints = get_type_hints(cls)
    values: dict[str, Any] = dict(extra or {})
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.init and field.name not in values and hasattr(args, field.name):
            value = getattr(args, field.name)
            inner, _ = _without_none(hints[field.name])
            if get_origin(inner) is tuple and value is not None:
                value = tuple(value)
            values[field.name] = value
    return cls(**values)
