"""Typed access to request bodies: a wrong type is a 400, a well-typed but unusable value a 422.
(`ds4_mlx.server.schema` checks the listed fields first: there a value out of range is a 400 too.)

Fields a handler does not use are ignored, so that a newer client keeps working; `note_ignored` logs
them at debug level so that what a client sends and the server does not honour can be seen.
"""

import logging

from ds4_mlx.server.errors import APIError

log = logging.getLogger("ds4_mlx.server")

_MISSING = object()
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "an object"}


def _is(value, kind) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def field(body: dict, name: str, kinds, default=None, *, required=False):
    """`body[name]` checked against one type or a tuple of types; None counts as absent."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise APIError(400, f"missing required field '{name}'", param=name)
        return default
    if not any(_is(value, k) for k in kinds):
        expected = " or ".join(_TYPE_NAMES[k] for k in kinds)
        raise APIError(400, f"'{name}' must be {expected}", param=name)
    return value


def number_in(body: dict, name: str, lo: float, hi: float, default=None):
    value = field(body, name, float, default)
    if value is not None and not lo <= value <= hi:
        raise APIError(422, f"'{name}' must be between {lo} and {hi}", param=name)
    return value


def positive_int(body: dict, name: str, default=None):
    value = field(body, name, int, default)
    if value is not None and value < 1:
        raise APIError(422, f"'{name}' must be at least 1", param=name)
    return value


def string_list(body: dict, name: str) -> list[str]:
    """A string or an array of strings (as `stop` is given)."""
    value = field(body, name, (str, list), [])
    values = [value] if isinstance(value, str) else value
    if not all(isinstance(v, str) for v in values):
        raise APIError(400, f"'{name}' must be a string or an array of strings", param=name)
    return [v for v in values if v]


def note_ignored(body: dict, used, where: str):
    """Log (debug) the fields of `body` outside `used`: accepted, but without effect here."""
    if log.isEnabledFor(logging.DEBUG):
        ignored = sorted(k for k in body if k not in used)
        if ignored:
            log.debug(f"{where}: ignored field(s) {', '.join(ignored)}")
