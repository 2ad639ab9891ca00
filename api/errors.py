"""Errors as RFC 9457 ``application/problem+json``, from one place.

Services raise the domain exceptions below; ``install_error_handlers`` turns them (and request
validation, malformed JSON, unknown routes and a locked/unreachable database) into problem
documents with a stable ``code``. Routes never build error JSON by hand; a 500 is a bug.
"""

from __future__ import annotations

import logging
import sys
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.schemas import Report

PROBLEM_MEDIA_TYPE = "application/problem+json"
PROBLEM_TYPE_PREFIX = "https://kvplane.dev/problems/"
RETRY_AFTER_S = 1
# What FastAPI says when json.loads fails with something other than a JSONDecodeError.
_UNPARSABLE = "There was an error parsing the body"

#: The one ``title`` of each status. The ``code`` (and ``type``) names the problem; the title
#: only words the status, the same for every code that shares it.
STATUS_TITLES: dict[int, str] = {
    400: "Malformed request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    412: "Precondition failed",
    413: "Payload too large",
    422: "Invalid request",
    429: "Too many requests",
    500: "Internal error",
    501: "Not implemented",
    503: "Service unavailable",
}


def status_title(status: int) -> str:
    """The title of ``status`` (:data:`STATUS_TITLES`, else the HTTP reason phrase)."""
    if status in STATUS_TITLES:
        return STATUS_TITLES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


log = logging.getLogger(__name__)


class FieldError(BaseModel):
    """One offending field: where (``loc``), what is wrong, and a machine code."""

    loc: list[str | int]
    msg: str
    code: str | None = None


class Problem(BaseModel):
    """RFC 9457 problem details with kvplane's stable ``code`` and optional field errors.

    Members other than ``type``, ``title``, ``status`` and ``code`` are sent only where they
    apply; clients should ignore members they do not know (RFC 9457), but every member kvplane
    sends is declared here.
    """

    model_config = ConfigDict(extra="allow")

    type: str = Field(description="URI naming the problem type")
    title: str = Field(description="Words the status: one title per status, whatever the code")
    status: int
    code: str = Field(description="Stable machine-readable error code")
    detail: str | None = None
    errors: list[FieldError] | None = None
    generation: int | None = Field(
        default=None, description="`precondition_failed`: the instance's current generation"
    )
    transfer_id: str | None = Field(
        default=None, description="`idempotency_key_reused`: the transfer the key belongs to"
    )
    report: Report | None = Field(
        default=None, description="`pairing_incompatible`: the pairing's validation report"
    )
    max_fragments_per_page: int | None = Field(
        default=None, description="`too_many_fragments`: the most fragments one page answers"
    )
    fragments: int | None = Field(
        default=None, description="`too_many_fragments`: the transfer's fragment count"
    )


class KvplaneError(Exception):
    """Base of every error kvplane reports to a client."""

    status = 500
    code = "internal_error"

    @property
    def title(self) -> str:
        return status_title(self.status)

    def __init__(
        self,
        detail: str,
        *,
        code: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        self.errors = errors
        self.headers = headers or {}
        self.extra = extra or {}


class BadRequest(KvplaneError):
    """The request is well-formed JSON but not acceptable (400 or 422)."""

    status = 422
    code = "bad_request"


class NotFound(KvplaneError):
    """The named resource does not exist."""

    status = 404
    code = "not_found"


class Conflict(KvplaneError):
    """The request conflicts with the resource's current state."""

    status = 409
    code = "conflict"


class Incompatible(Conflict):
    """The pairing is not compatible (or stale), so no plan can be compiled."""

    code = "incompatible"


class LeaseLost(Conflict):
    """A worker's lease token is no longer current (fencing)."""

    code = "lease_lost"


class Unauthorized(KvplaneError):
    """No bearer token, or one that is unknown or revoked."""

    status = 401
    code = "unauthorized"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": 'Bearer realm="kvplane"'})


class Forbidden(KvplaneError):
    """A valid token whose scope (or bound instance) does not cover the request."""

    status = 403
    code = "forbidden"


class PreconditionFailed(KvplaneError):
    """An ``If-Match`` precondition did not hold."""

    status = 412
    code = "precondition_failed"


class PayloadTooLarge(KvplaneError):
    """The request body exceeds the configured limit."""

    status = 413
    code = "payload_too_large"


class Unavailable(KvplaneError):
    """A dependency (the database) is busy or unreachable; retry later."""

    status = 503
    code = "unavailable"


class NotImplementedYet(KvplaneError):
    """The feature exists in the API but not in this release."""

    status = 501
    code = "not_implemented"


#: Stable codes and where they come from; docs/api.md's error table lists them.
ERROR_CODES: dict[str, tuple[int, str]] = {
    "validation_error": (422, "A field has the wrong type, range or format; see `errors[].loc`."),
    "malformed_json": (
        400,
        "The body is not valid JSON (or not UTF-8, nested too deeply, an integer too long); "
        "`detail` says which.",
    ),
    "invalid_geometry": (422, "The registration breaks a page-table rule; see `errors[].loc`."),
    "payload_too_large": (413, "The body exceeds `KVPLANE_MAX_BODY_BYTES`."),
    "unauthorized": (401, "Auth is on and the bearer token is missing, unknown or revoked."),
    "forbidden": (403, "The token's scope or bound instance does not cover this request."),
    "instance_not_found": (404, "No instance with that name."),
    "pairing_not_found": (404, "No pairing with that id (or for that context/generation)."),
    "transfer_not_found": (404, "No transfer with that id."),
    "not_found": (404, "Unknown route."),
    "method_not_allowed": (405, "The route does not accept this method."),
    "precondition_failed": (412, "`If-Match` does not equal the instance's `generation`."),
    "wrong_role": (409, "Context/generation swapped (422 for inline compatibility bodies)."),
    "conflict": (409, "A concurrent request changed the same resource; retry."),
    "pairing_stale": (409, "An instance re-registered since validation; POST .../validate."),
    "pairing_incompatible": (409, "The pairing's last validation found errors."),
    "incompatible": (409, "The planning core refused to compile a plan."),
    "dp_rank_required": (422, "The instance uses attention DP: name the dp rank."),
    "dp_rank_out_of_range": (422, "The dp rank is not below the instance's tp."),
    "invalid_blocks": (422, "A block id is out of range or a layer group is unknown."),
    "idempotency_key_reused": (409, "The Idempotency-Key was used with a different body."),
    "plan_gone": (409, "The transfer's plan was deleted with its pairing."),
    "too_many_fragments": (
        422,
        "More fragments than one page holds (`KVPLANE_MAX_FRAGMENTS_PER_PAGE`, 50,000 by "
        "default): page with `?offset=&limit=`.",
    ),
    "not_implemented": (501, "The feature exists in the API but not in this release."),
    "database_busy": (503, "The database is locked or unreachable; honour `Retry-After`."),
    "not_ready": (503, "`/readyz`: the database is unreachable or not migrated to head."),
    "workers_unavailable": (503, "`execute=true`: a rank has no live worker; `Retry-After`."),
    "staging_busy": (503, "A receiver's staging buffer is full of other transfers; retry."),
    "staging_too_small": (422, "A receiver's staging buffer cannot hold this transfer."),
    "pool_mismatch": (409, "A worker's pools differ from the rank's registered pools."),
    "rank_not_reported": (409, "A worker attached to a rank that has not reported yet."),
    "worker_not_found": (404, "No worker with that id."),
    "worker_retired": (409, "The worker was stopped (DELETE); attach a new one."),
    "worker_stale": (409, "The instance re-registered since the worker attached."),
    "job_not_found": (404, "No job with that id."),
    "lease_lost": (409, "The job's lease expired or its transfer was retried (fencing)."),
    "transfer_not_retryable": (409, "Only a failed executed transfer can be retried."),
    "internal_error": (500, "A bug: please report it."),
}


def problem_response(
    status: int,
    code: str,
    detail: str | None = None,
    *,
    errors: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    """A problem+json response (the one place error JSON is built)."""
    body: dict[str, Any] = {
        "type": PROBLEM_TYPE_PREFIX + code,
        "title": status_title(status),
        "status": status,
        "code": code,
    }
    if detail is not None:
        body["detail"] = detail
    if errors is not None:
        body["errors"] = errors
    if extra:
        body.update(extra)
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_MEDIA_TYPE)


def _jsonable_loc(loc: Any) -> list[str | int]:
    return [part if isinstance(part, int) else str(part) for part in loc]


def validation_problem(exc: RequestValidationError) -> JSONResponse:
    """422 naming each offending field, or 400 when the body is not JSON at all."""
    raw = exc.errors()
    if any(err.get("type") == "json_invalid" for err in raw):
        return problem_response(
            400,
            "malformed_json",
            "The request body is not valid JSON.",
            errors=[
                {"loc": _jsonable_loc(err.get("loc", ())), "msg": str(err.get("msg", ""))}
                for err in raw
            ],
        )
    errors = [
        {
            "loc": _jsonable_loc(err.get("loc", ())),
            "msg": str(err.get("msg", "")),
            "code": str(err.get("type", "invalid")),
        }
        for err in raw
    ]
    fields = ", ".join(".".join(str(p) for p in e["loc"]) for e in errors[:5])
    return problem_response(422, "validation_error", f"Invalid field(s): {fields}", errors=errors)


def undecodable_body_detail(cause: BaseException) -> str:
    """Why a request body could not be decoded as JSON, in words a client can act on."""
    if isinstance(cause, UnicodeDecodeError):
        return f"The request body is not valid UTF-8 (byte {cause.start})."
    if isinstance(cause, RecursionError):
        return "The request body's JSON is nested too deeply."
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return (
            "The request body holds an integer with more digits than the parser accepts "
            f"({sys.get_int_max_str_digits()})."
        )
    return f"The request body is not valid JSON ({type(cause).__name__})."


def install_error_handlers(app: FastAPI) -> None:
    """Register the problem+json handlers on ``app``."""

    @app.exception_handler(KvplaneError)
    async def _kvplane_error(_request: Request, exc: KvplaneError) -> JSONResponse:
        return problem_response(
            exc.status,
            exc.code,
            exc.detail,
            errors=exc.errors,
            headers=exc.headers,
            extra=exc.extra,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_problem(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == _UNPARSABLE and exc.__cause__ is not None:
            # FastAPI could not decode the body at all (json.loads raised something other than
            # a JSONDecodeError): still the documented malformed_json, with the reason.
            detail = undecodable_body_detail(exc.__cause__)
            return problem_response(
                400, "malformed_json", detail, errors=[{"loc": ["body"], "msg": detail}]
            )
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            from api.routes import allowed_methods

            headers["Allow"] = ", ".join(allowed_methods(request.app, request.scope["path"]))
        return problem_response(exc.status_code, code, str(exc.detail), headers=headers)

    @app.exception_handler(OperationalError)
    async def _database_error(_request: Request, exc: OperationalError) -> JSONResponse:
        log.warning("database unavailable: %s", exc.orig)
        return problem_response(
            503,
            "database_busy",
            "The database is locked or unreachable; retry.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return problem_response(500, "internal_error", "A bug: please report it.")


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries documenting problem+json for ``statuses``."""
    descriptions = {
        400: "Malformed request (problem+json)",
        401: "Missing, unknown or revoked bearer token (problem+json)",
        403: "The token's scope does not cover this request (problem+json)",
        404: "Not found (problem+json)",
        409: "Conflict (problem+json)",
        412: "Precondition failed (problem+json)",
        413: "Payload too large (problem+json)",
        422: "Invalid request: field errors in `errors` (problem+json)",
        429: "Too many requests; see Retry-After (problem+json)",
        501: "Not implemented (problem+json)",
        503: "Database busy or unreachable; see Retry-After (problem+json)",
    }
    return {
        status: {
            "model": Problem,
            "description": descriptions.get(status, "Problem"),
            "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
        for status in statuses
    }
