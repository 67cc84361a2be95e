"""The state and checks behind the routes of `zoo serve` (`app.create_app`): limits, the served name, the
API key, token budgets, running work on the engine thread, prompts from chat messages, the SSE stream of one
answer, cancellation on disconnect, and the OpenAI error envelope for every error.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

from fastapi import FastAPI, Header
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import Request as StarletteRequest

from zoo.batch import GroupBatch
from zoo.datamodules.bad_samples import BadSample
from zoo.datamodules.chat import Turn
from zoo.inference import Pipeline
from zoo.serve.chat import (
    MediaLimits,
    MediaPart,
    PartError,
    audio_from_base64,
    image_from_data_url,
)
from zoo.serve.engine import Engine, QueueFull
from zoo.serve.generation import TextParams, TextRun
from zoo.serve.protocol import (
    APIError,
    AudioContent,
    ImageContent,
    Message,
    Sampling,
    error_body,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
USER_ERRORS = (ValueError, TypeError, BadSample)  # what the pipeline raises for a request it cannot answer


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask.

    Args:
        max_tokens: most tokens one text answer may ask for (400 past it); also the default.
        max_stop: most stop strings.
        request_timeout: seconds a request may take, queueing included (504 past it).
        max_images: most images one generation request may ask for.
        max_audio_frames: most codec frames of a speech answer.
        max_best_of: most candidates one image or speech request may draw to keep the best of
            (`best_of`, `zoo.inference.best_of`): each costs a whole generation.
        retry_after_s: what `Retry-After` says on a 429.
        media: input image and audio limits (`zoo.serve.chat.MediaLimits`).
    """

    max_tokens: int = 256
    max_stop: int = 4
    request_timeout: float = 60.0
    max_images: int = 4
    max_audio_frames: int = 160
    max_best_of: int = 16
    retry_after_s: int = 1
    media: MediaLimits = field(default_factory=MediaLimits)


class Server:
    """The handlers' state: the pipeline, its engine, the served model's name and the limits."""

    def __init__(
        self, pipe: Pipeline, model_name: str, engine: Engine, limits: ServeLimits, api_key: str | None
    ) -> None:
        self.pipe, self.model_name, self.engine, self.limits = pipe, model_name, engine, limits
        self.api_key = api_key
        self.created = int(time.time())
        self.context = pipe.model.backbone.max_seq_len

    # -- checks ---------------------------------------------------------------------------------------
    def authorize(self, authorization: Annotated[str | None, Header()] = None) -> None:
        if self.api_key is None:
            return
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(
                401, "incorrect or missing API key (Authorization: Bearer ...)", code="invalid_api_key"
            )

    def check_model(self, name: str | None) -> None:
        if name != self.model_name:
            raise APIError(
                404, f"the model {name!r} does not exist; this server serves {self.model_name!r}", "model",
                "model_not_found",
            )  # fmt: skip

    def deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.limits.request_timeout

    def text_params(self, body: Sampling, prompt_tokens: int, requested: int | None) -> TextParams:
        """The request's sampling settings, its token budget checked against the limit and the context."""
        cap = self.limits.max_tokens
        if requested is not None and requested > cap:
            raise APIError(400, f"max_tokens is {requested}; this server allows at most {cap}", "max_tokens")
        room = self.context - prompt_tokens
        if requested is not None and requested > room:
            raise APIError(
                400, f"the prompt takes {prompt_tokens} tokens and max_tokens asks for {requested}: "
                f"{prompt_tokens + requested} exceed the model's context of {self.context}", "max_tokens",
                "context_length_exceeded",
            )  # fmt: skip
        if room < 1:
            raise APIError(
                400, f"the prompt takes {prompt_tokens} tokens: no room is left in the model's context of "
                f"{self.context}", "messages", "context_length_exceeded",
            )  # fmt: skip
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > self.limits.max_stop or not all(stop):
            raise APIError(400, f"stop: give at most {self.limits.max_stop} non-empty strings", "stop")
        temperature = 1.0 if body.temperature is None else body.temperature  # 0 is greedy, not "unset"
        return TextParams(requested or min(cap, room), temperature, body.top_p, body.top_k, body.seed, stop)

    # -- running things on the engine thread ---------------------------------------------------------------
    async def job(self, fn: Callable[[], T], deadline: float) -> T:
        """`fn` on the engine thread; the pipeline's refusals (ValueError, ...) become 400s."""
        try:
            future = self.engine.call(fn)
        except QueueFull as error:
            raise self.busy(error) from None
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), max(deadline - loop.time(), 0.0))
        except TimeoutError:
            future.cancel()
            raise APIError(504, "the request took longer than the server's request timeout", code="timeout",
                           kind="timeout_error") from None  # fmt: skip
        except USER_ERRORS as error:  # a ChatError names the message at fault
            raise APIError(400, str(error), getattr(error, "param", None)) from None

    def busy(self, error: Exception) -> APIError:
        return APIError(
            429, f"the server is busy: {error}; retry later", code="queue_full", kind="rate_limit_error",
            headers={"Retry-After": str(self.limits.retry_after_s)},
        )  # fmt: skip

    def run(self, prompt: GroupBatch, params: TextParams) -> TextRun:
        return TextRun(self.engine, self.pipe, prompt, params, self.limits.retry_after_s)

    async def chat_prompt(self, messages: list[Message], deadline: float) -> GroupBatch:
        """The conversation's prompt batch (`Pipeline.conversation_batch`: the chat format, or the plain
        layout for a model without role tokens), its media decoded on the engine thread."""
        requested = [self.turn(i, m) for i, m in enumerate(messages)]

        def build() -> GroupBatch:
            turns = [
                Turn(role, tuple(p if isinstance(p, str) else self.pipe.read_media(p.kind, p.data, p.where)
                                 for p in parts), where)
                for role, parts, where in requested
            ]  # fmt: skip
            return self.pipe.conversation_batch(turns)

        return await self.job(build, deadline)

    def ids_prompt(self, ids: list[int]) -> GroupBatch:
        """A prompt of unified token ids (lm-eval's tokenized requests), `<bos>` first."""
        if len(ids) + 1 > self.context:
            raise APIError(400, f"the prompt takes {len(ids)} tokens; the context is {self.context}",
                           "prompt", "context_length_exceeded")  # fmt: skip
        try:
            return self.pipe.ids_batch(ids)
        except ValueError as error:
            raise APIError(400, str(error), "prompt") from None

    async def prompt(self, text: str | None, media: MediaPart | None, deadline: float) -> GroupBatch:
        if media is None:
            try:
                return self.pipe.prompt_batch(text)
            except USER_ERRORS as error:
                raise APIError(400, str(error)) from None
        where = f" ({media.where})"

        def read() -> GroupBatch:
            return self.pipe.prompt_batch(text, **{media.kind: media.data})

        try:
            return await self.job(read, deadline)  # the visual tokenizer may run: on the engine thread
        except APIError as error:
            if error.status == 400:
                error.message, error.param = error.message + where, media.where
            raise

    def turn(self, index: int, message: Message) -> tuple[str, list[str | MediaPart], str]:
        """A message as (role, its texts and media parts as sent, where it is in the request)."""
        where, content = f"messages[{index}]", message.content
        if content is None or isinstance(content, str):
            return message.role, [content or ""], where
        parts: list[str | MediaPart] = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            try:
                if isinstance(part, ImageContent):
                    parts.append(image_from_data_url(part.image_url.url, at, self.limits.media))
                elif isinstance(part, AudioContent):
                    audio = part.input_audio
                    parts.append(audio_from_base64(audio.data, audio.format, at, self.limits.media))
                else:
                    parts.append(part.text)
            except PartError as error:
                raise APIError(error.status, str(error), error.param) from None
        return message.role, parts, where

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "zoo"}
        return {"object": "list", "data": [card]}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


Chunk = Callable[[str | None, str | None], dict]  # (piece or None, finish_reason or None) -> one SSE chunk


async def stream_events(
    run: TextRun, deadline: float, chunk: Chunk, usage_chunk: dict | None, first: dict | None
) -> AsyncIterator[str]:
    """SSE events of one answer: `first` (chat's role delta), a chunk per piece, the finishing chunk, the
    usage chunk (`include_usage`), `[DONE]`; an error mid-stream is an error event and no `[DONE]`. The
    `finally` frees the engine's row when the client goes away (Starlette cancels this generator)."""
    try:
        if first is not None:
            yield sse(first)
        try:
            async for piece in run.pieces(deadline):
                yield sse(chunk(piece, None))
        except APIError as error:
            yield sse(error.body())
            return
        yield sse(chunk(None, run.finish_reason))
        if usage_chunk is not None:
            yield sse({**usage_chunk, "usage": run.usage()})
        yield sse("[DONE]")
    finally:
        run.close()


async def collect(run: TextRun, deadline: float) -> str:
    return "".join([piece async for piece in run.pieces(deadline)])


class ClientGone(Exception):
    """The client closed the connection before its (non-streamed) answer was ready."""


async def unless_disconnected(request: StarletteRequest, work: Awaitable[T]) -> T:
    """`work`, cancelled when the client disconnects (vLLM's `with_cancellation`): a non-streamed request
    then frees its engine row at once instead of generating for no one. The body has been read, so the
    next ASGI message can only be `http.disconnect`."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, APIError):
        await task  # its `finally` aborts the engine's rows
    raise ClientGone


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError) -> JSONResponse:
        first = max(error.errors(), key=lambda e: len(e.get("loc", ())))  # the deepest says most
        param = field_path(first.get("loc", ()))
        kind = first.get("type", "invalid")
        if kind == "json_invalid":
            message, param = (
                f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                None,
            )
        elif kind == "extra_forbidden":
            message = f"unsupported parameter {param!r}: this server does not support it (yet)"
        elif kind == "missing":
            message = f"missing required parameter {param!r}"
        else:
            message = f"{param}: {first['msg']}" if param else first["msg"]
        return JSONResponse(error_body(message, "invalid_request_error", param, kind), status_code=400)

    @app.exception_handler(ClientGone)
    async def gone(request, error: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": no one reads it

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(
            error_body(message, "invalid_request_error"), status_code=error.status_code, headers=error.headers
        )

    @app.exception_handler(Exception)
    async def crash(request, error: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        message = f"internal server error: {type(error).__name__}: {error}"
        return JSONResponse(error_body(message, "server_error"), status_code=500)


_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "none"}


def field_path(loc: tuple) -> str | None:
    """A pydantic error location as the request field a person wrote, `messages[0].content[1].text`:
    without `body` and the labels of union branches and discriminator tags that pydantic adds."""
    path, tag_next = "", False
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        if part == "body" and not path:
            continue
        if "[" in part or part in _BRANCHES:  # a union branch's label
            tag_next = "tagged-union" in part
            continue
        if tag_next:  # the discriminator's value after a tagged union's index
            tag_next = False
            continue
        path += f".{part}" if path else part
    return path or None
