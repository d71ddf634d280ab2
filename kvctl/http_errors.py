"""How the daemons' HTTP APIs (the agent's and the router's) answer errors: a ``KvctlError``
as its status with a JSON ``detail``, and FastAPI's 422 with echoed inputs that never carry a
secret's value, are clipped (a model-level error echoes the whole body), are valid JSON (no
NaN) and list at most ``MAX_ERRORS`` errors; and how their OpenAPI schemas state those answers
(``error_responses``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from kvctl.errors import KvctlError
from kvctl.http_guards import clip_echo, safe_text

MAX_ERRORS = 20
#: request fields whose value a 422 never echoes
SECRET_FIELDS = frozenset({"token"})


class ErrorDetail(BaseModel):
    detail: str = Field(description="what was wrong, naming the bad value")


def error_responses(texts: Mapping[int, str], *codes: int) -> dict[int | str, dict[str, Any]]:
    """Schema entries for the error statuses an operation can answer, each an ``ErrorDetail``
    described by ``texts`` (what the status means on this API); 401 and 413 can come from every
    one (the auth and body-limit middleware)."""
    return {
        code: {"model": ErrorDetail, "description": texts[code]}
        for code in sorted({401, 413, *codes})
    }


def _redact(value: Any) -> Any:
    """An input echoed in a validation error, with secret fields' values blanked out."""
    if isinstance(value, dict):
        return {k: "***" if k in SECRET_FIELDS else _redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v) for v in value]
    return value


def _error(status: int) -> Callable[[Request, Exception], Response]:
    def handler(_request: Request, exc: Exception) -> Response:
        return JSONResponse({"detail": safe_text(str(exc))}, status_code=status)

    return handler


async def _validation_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    all_errors = exc.errors()
    errors = []
    for err in all_errors[:MAX_ERRORS]:
        err = dict(err)
        loc = err.get("loc") or ()
        if loc and loc[-1] in SECRET_FIELDS:
            err["input"] = "***"
        elif "input" in err:
            err["input"] = _redact(clip_echo(err["input"]))
        if "ctx" in err:  # limits, and for a validator's error the exception itself
            err["ctx"] = clip_echo(err["ctx"])
        err["msg"] = safe_text(str(err.get("msg", "")))
        errors.append(err)
    if len(all_errors) > MAX_ERRORS:
        errors.append(
            {
                "type": "too_many_errors",
                "loc": ["body"],
                "msg": f"{len(all_errors) - MAX_ERRORS:,} more errors not listed",
            }
        )
    return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)


def install_error_handlers(app: FastAPI, statuses: Mapping[type[KvctlError], int]) -> None:
    """Answer each exception type in ``statuses`` with its status, and validation errors as
    above."""
    for exc_type, status in statuses.items():
        app.add_exception_handler(exc_type, _error(status))
    app.add_exception_handler(RequestValidationError, _validation_error)
