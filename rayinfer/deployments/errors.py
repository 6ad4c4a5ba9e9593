"""What a client is told when its request fails, and what the server log keeps.

Every failure becomes an OpenAIError with a short message and the request id. Ray wraps what a
replica raised (RayTaskError, with the remote traceback and the worker's pid in its text); the
cause is unwrapped and only rayinfer's own messages reach the client: a bad value is a 400
naming its field, a request the engine failed alone a 500 naming why, a replica that lost its
engine a 503 to retry, anything else a 500 that points at the log. 5xx are logged with their
traceback under the request id, but a request shed for overload (503 `overloaded`) in one
line. A request Serve cancelled because its client went away (the proxy cancels the ingress's
task; its ASGI `receive` then raises TaskCancelledError) is CLIENT_CLOSED, nginx's 499: no one
reads that answer, and it is no server error.
"""

from __future__ import annotations

import logging

import ray
from ray.serve.exceptions import BackPressureError

from rayinfer.deployments.engine_loop import EngineStoppedError
from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.engine.outputs import RequestFailedError
from rayinfer.engine.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499
CLIENT_GONE_ERRORS = (ray.exceptions.TaskCancelledError,)

REPLICA_LOST_ERRORS = (
    EngineStoppedError,
    ray.exceptions.RayActorError,  # ActorDiedError too
    ray.exceptions.ActorUnavailableError,
)


def as_openai_error(error: BaseException, request_id: str) -> OpenAIError:
    """The client's view of `error`; 5xx are logged here with the whole traceback."""
    answer = _classify(root_cause(error), request_id)
    if answer.request_id is None:
        answer.request_id = request_id
    if answer.status == CLIENT_CLOSED:
        logger.info("request %s: the client closed it", request_id)
    elif answer.code == "overloaded":  # load shed on purpose: its traceback tells nothing
        logger.warning("request %s shed with %d: %s", request_id, answer.status, answer.message)
    elif answer.status >= 500:
        logger.error(
            "request %s failed with %d: %s",
            request_id,
            answer.status,
            answer.message,
            exc_info=(type(error), error, error.__traceback__),
        )
    return answer


def root_cause(error: BaseException) -> BaseException:
    """What a replica raised, out of Ray's RayTaskError wrappers."""
    while isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        if error.cause is error:
            break
        error = error.cause
    return error


def _classify(error: BaseException, request_id: str) -> OpenAIError:
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, InvalidRequestError):
        return OpenAIError(400, str(error), param=error.field)
    if isinstance(error, RequestFailedError):
        return OpenAIError(
            500, f"the engine could not finish this request: {error.reason}", code="request_failed"
        )
    if isinstance(error, CLIENT_GONE_ERRORS):
        return OpenAIError(CLIENT_CLOSED, "the client closed the request", code="client_closed")
    if isinstance(error, BackPressureError):
        return OpenAIError(503, "the replicas are full; retry shortly", code="overloaded")
    if isinstance(error, REPLICA_LOST_ERRORS):
        return OpenAIError(
            503,
            "the replica serving this request lost its engine and is being replaced; retry",
            code="replica_unavailable",
        )
    return OpenAIError(
        500,
        f"internal error; the server log has its details under request id {request_id}",
        code="internal_error",
    )
