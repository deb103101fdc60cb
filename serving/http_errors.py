"""The HTTP API's errors: every failure answers as an OpenAI error object with its status.

    openai_error(refused)    admission's errors (`serving/admission.py`): the queue limit 429, a duplicate
                             id 409, a client not reading 500, no engine or a lost stage 503, the engine
                             failing the request 500 (gRPC maps the same kinds in `serving/server.py`)
    add_error_handlers(app)  FastAPI's and Starlette's own errors (422 -> 400 naming the field, no route,
                             wrong method, a body that is not JSON), InvalidRequestError (400 naming the
                             field), and any other exception (500, still an error object)
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxcpp.errors import InvalidRequestError
from jaxcpp.serving.admission import Refused
from jaxcpp.serving.openai_protocol import OpenAIError

log = logging.getLogger(__name__)

_STATUS = {"full": 429, "duplicate": 409, "stalled": 500, "unavailable": 503, "failed": 500}  # `Refused.kind`


def openai_error(refused: Refused) -> OpenAIError:
    """Admission's error as the API's: its kind's status, its message."""
    return OpenAIError(_STATUS[refused.kind], str(refused))


def add_error_handlers(app: FastAPI) -> None:
    """Every error a route or FastAPI raises answers as an OpenAI error object."""
    app.add_exception_handler(OpenAIError, _error_response)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(InvalidRequestError, _invalid_request)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)  # a bug: still an error object, not plain text


async def _error_response(request: Request, error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400, naming the first field that failed (none for a body that is
    not JSON, or not a JSON object)."""
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return await _error_response(request, OpenAIError(400, f"the body is not valid JSON: {detail} (at "
                                                               f"character {first['loc'][-1]})"))
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg', 'invalid request')}" if param else \
        f"the body must be a JSON object: {first.get('msg', 'invalid request')}"
    return await _error_response(request, OpenAIError(400, message, param))


async def _invalid_request(request: Request, error: InvalidRequestError) -> JSONResponse:
    """What a route did not turn into an OpenAIError itself (/tokenize's checks): 400 naming the field."""
    return await _error_response(request, OpenAIError.invalid(error))


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's own answers (no route, wrong method, a body FastAPI could not parse) as error objects."""
    if error.status_code == 404:
        message = f"no route {request.method} {request.url.path}: see /docs for the API"
    elif error.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path} (allowed: " \
                  f"{(error.headers or {}).get('Allow', '?')})"
    elif error.status_code == 400 and error.__cause__ is not None:  # json.loads raised, not with a JSON error:
        cause = error.__cause__  # invalid UTF-8, a number past Python's 4,300 digits, nesting too deep
        message = f"the body could not be parsed as JSON: {type(cause).__name__}: {str(cause)[:200]}"
    else:
        message = str(error.detail)
    response = await _error_response(request, OpenAIError(error.status_code, message))
    response.headers.update(error.headers or {})
    return response


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    log.error("HTTP %s %s failed: %r", request.method, request.url.path, error)
    return await _error_response(request, OpenAIError(500, f"internal error: {type(error).__name__}: {error}"))
