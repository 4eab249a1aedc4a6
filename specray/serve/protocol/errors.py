"""OpenAI-style error bodies, and validation errors turned into messages a user can act on.

A 400 names the field and what is allowed ("temperature: must be <= 2 (got 5)"), worded like OpenAI's own
API, because a raw pydantic dump tells a client author little.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError


class InvalidRequest(ValueError):
    """A request that parsed but cannot be served (e.g. prompt longer than the context): HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_response_body(str(self), param=self.param)


class Busy(RuntimeError):
    """An operation that needs an idle server (resetting the prefix caches) asked for while requests run: 409."""


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error envelope: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


def error_response_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return ErrorBody(error=ErrorDetail(message=message, type=type, param=param, code=code)).model_dump()


def model_not_found_body(model: str) -> dict[str, Any]:
    """Body of the 404 for an unknown model (OpenAI's wording and code)."""
    return error_response_body(
        f"The model `{model}` does not exist or you do not have access to it.", param="model", code="model_not_found"
    )


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"})


def _param(loc: tuple[int | str, ...]) -> str | None:
    """Dotted field path ("messages[0].content"), without pydantic's union/validator tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_NAMES or any(c in part for c in "[]-"):
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def _num(x: Any) -> str:
    if isinstance(x, float) and x.is_integer() and math.isfinite(x):
        return str(int(x))
    return str(x)


def _got(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return _num(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "...")
    if isinstance(value, (list, dict)):
        return f"a {type(value).__name__} of {len(value)} item{'' if len(value) == 1 else 's'}"
    return type(value).__name__


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _describe(err: Mapping[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in _BOUNDS:
        bound = ctx[{"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt"}.get(kind, "le")]
        text = f"must be {_BOUNDS[kind]} {_num(bound)}"
    elif kind == "missing":
        return "field required"
    elif kind == "extra_forbidden":
        return "unknown field (not supported by this API)"
    elif kind == "json_invalid":
        return f"invalid JSON body: {ctx.get('error', err['msg'])}"
    elif kind in ("model_type", "model_attributes_type") and not err["loc"]:
        return "the request body must be a JSON object"
    elif kind in ("too_short", "too_long"):
        n = ctx.get("min_length" if kind == "too_short" else "max_length")
        return f"must have at {'least' if kind == 'too_short' else 'most'} {n} item{'' if n == 1 else 's'}"
    elif kind == "literal_error":
        text = f"must be one of {ctx.get('expected')}"
    elif kind == "finite_number":
        text = "must be a finite number"
    elif kind in ("value_error", "assertion_error"):
        text = str(ctx.get("error") or err["msg"].split(", ", 1)[-1])
    else:
        text = err["msg"].replace("Input should be", "must be").replace("Input", "value")
        text = text[:1].lower() + text[1:]
    if "(got" not in text and "input" in err and err["loc"]:
        text += f" (got {_got(err['input'])})"
    return text


def validation_error_to_openai(exc: ValidationError | Any) -> tuple[int, dict[str, Any]]:
    """400 and an OpenAI error body whose message names the field and what is allowed, e.g.
    "temperature: must be <= 2 (got 5)". Up to three problems are listed; `param` is the first field.

    Also takes FastAPI's RequestValidationError (same error dicts, locations prefixed with "body")."""
    raw = exc.errors(include_url=False) if isinstance(exc, ValidationError) else exc.errors()
    errors = []
    for err in raw:
        loc = tuple(err.get("loc", ()))
        errors.append({**err, "loc": loc[1:] if loc[:1] == ("body",) else loc})
    parts = []
    for err in errors[:3]:
        param = _param(err["loc"])
        parts.append(f"{param}: {_describe(err)}" if param else _describe(err))
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more")
    first = _param(errors[0]["loc"]) if errors else None
    return 400, error_response_body("; ".join(parts) or "invalid request", param=first)
