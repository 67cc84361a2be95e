"""The OpenAI-compatible HTTP API of `zoo serve`: a FastAPI app over one `Pipeline` and its `Engine`.

    app = create_app(zoo.pipeline("export/"), "zoo-tiny", api_key="secret")
    uvicorn.run(app, host="127.0.0.1", port=8000, workers=1)

Endpoints: `GET /health`; `GET /v1/models`; `POST /v1/chat/completions` (text, `image_url` data URLs and
`input_audio` parts, streaming by server-sent events); `POST /v1/completions` (prompt strings);
`POST /v1/images/generations` (b64_json PNGs); `POST /v1/audio/speech` (WAV or FLAC bytes);
`POST /v1/audio/transcriptions` (multipart). Text requests are batched continuously by the engine's thread;
media generation and prompts with media run there too, whole, between decode steps (the model is never used
by two threads). Why FastAPI and not LitServe: REFERENCES.md part D, section 3 (LitServe batches statically,
its continuous loop never sees disconnects, and it serves chat only).

Every error is OpenAI's envelope `{"error": {"message", "type", "param", "code"}}`: 400 for a malformed
body or field (FastAPI's 422 included) and for a request past the context or a limit, 401 for a wrong
API key, 404 for an unknown model or route, 413 for an oversized payload, 429 with `Retry-After` when the
queue is full, 504 past the request timeout. A user's error is never a 500 (the `openai` SDK retries
those).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import io
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

import soundfile as sf
from fastapi import APIRouter, Depends, FastAPI, File, Form, Header, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request as StarletteRequest

from zoo.batch import GroupBatch
from zoo.datamodules.bad_samples import BadSample
from zoo.inference import Pipeline
from zoo.serve.chat import (
    ChatError,
    MediaLimits,
    MediaPart,
    TextPart,
    Turn,
    audio_from_base64,
    check_audio_length,
    image_from_data_url,
    lay_out,
)
from zoo.serve.engine import Engine, QueueFull
from zoo.serve.generation import TextParams, TextRun
from zoo.serve.protocol import (
    APIError,
    AudioContent,
    ChatRequest,
    CompletionRequest,
    ImageContent,
    ImageRequest,
    Message,
    Sampling,
    SpeechRequest,
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
        retry_after_s: what `Retry-After` says on a 429.
        media: input image and audio limits (`zoo.serve.chat.MediaLimits`).
    """

    max_tokens: int = 256
    max_stop: int = 4
    request_timeout: float = 60.0
    max_images: int = 4
    max_audio_frames: int = 160
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
        except USER_ERRORS as error:
            raise APIError(400, str(error)) from None

    def busy(self, error: Exception) -> APIError:
        return APIError(
            429, f"the server is busy: {error}; retry later", code="queue_full", kind="rate_limit_error",
            headers={"Retry-After": str(self.limits.retry_after_s)},
        )  # fmt: skip

    def run(self, prompt: GroupBatch, params: TextParams) -> TextRun:
        return TextRun(self.engine, self.pipe, prompt, params, self.limits.retry_after_s)

    async def chat_prompt(self, messages: list[Message], deadline: float) -> GroupBatch:
        turns = [self.turn(i, m) for i, m in enumerate(messages)]
        try:
            prompt = lay_out(turns)
        except ChatError as error:
            raise APIError(error.status, str(error), error.param) from None
        return await self.prompt(prompt.text, prompt.media, deadline)

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

    def turn(self, index: int, message: Message) -> Turn:
        content = message.content
        if content is None or isinstance(content, str):
            return Turn(message.role, (TextPart(content or ""),))
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{index}].content[{j}]"
            try:
                if isinstance(part, ImageContent):
                    parts.append(image_from_data_url(part.image_url.url, where, self.limits.media))
                elif isinstance(part, AudioContent):
                    audio = part.input_audio
                    parts.append(audio_from_base64(audio.data, audio.format, where, self.limits.media))
                else:
                    parts.append(TextPart(part.text))
            except ChatError as error:
                raise APIError(error.status, str(error), error.param) from None
        return Turn(message.role, tuple(parts))

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "zoo"}
        return {"object": "list", "data": [card]}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _stream(run: TextRun, deadline: float, chunk: Callable[[str | None, str | None], dict],
                  usage_chunk: dict | None, first: dict | None) -> AsyncIterator[str]:  # fmt: skip
    """SSE events of one answer: `first` (chat's role delta), a chunk per piece, the finishing chunk, the
    usage chunk (`include_usage`), `[DONE]`; an error mid-stream is an error event and no `[DONE]`. The
    `finally` frees the engine's row when the client goes away (Starlette cancels this generator)."""
    try:
        if first is not None:
            yield _sse(first)
        try:
            async for piece in run.pieces(deadline):
                yield _sse(chunk(piece, None))
        except APIError as error:
            yield _sse(error.body())
            return
        yield _sse(chunk(None, run.finish_reason))
        if usage_chunk is not None:
            yield _sse({**usage_chunk, "usage": run.usage()})
        yield _sse("[DONE]")
    finally:
        run.close()


async def _collect(run: TextRun, deadline: float) -> str:
    return "".join([piece async for piece in run.pieces(deadline)])


class ClientGone(Exception):
    """The client closed the connection before its (non-streamed) answer was ready."""


async def _unless_disconnected(request: StarletteRequest, work: Awaitable[T]) -> T:
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


def create_app(
    pipe: Pipeline,
    model_name: str,
    engine: Engine | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    limits: ServeLimits = ServeLimits(),
    api_key: str | None = None,
) -> FastAPI:
    """The app serving `pipe` as `model_name`. The engine (made with max_batch/max_queue unless given)
    starts with the app and stops with it."""
    engine = engine or Engine(pipe.model, max_batch=max_batch, max_queue=max_queue)
    server = Server(pipe, model_name, engine, limits, api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title=f"zoo serve: {model_name}", lifespan=lifespan)
    app.state.server, app.state.engine = server, engine
    _add_error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(server.authorize)])

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name, "active": engine.active}

    @v1.get("/models")
    async def models() -> dict:
        return server.models()

    @v1.get("/models/{name}")
    async def model(name: str) -> dict:
        server.check_model(name)
        return server.models()["data"][0]

    @v1.post("/chat/completions")
    async def chat(body: ChatRequest, request: StarletteRequest):
        server.check_model(body.model)
        deadline = server.deadline()
        if body.max_tokens is not None and body.max_completion_tokens not in (None, body.max_tokens):
            raise APIError(400, "max_tokens and max_completion_tokens differ: give one", "max_tokens")
        prompt = await server.chat_prompt(body.messages, deadline)
        params = server.text_params(body, prompt.seq_len, body.max_completion_tokens or body.max_tokens)
        run = server.run(prompt, params)
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": ident, "created": created, "model": model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            base = {**head, "object": "chat.completion.chunk"} | ({"usage": None} if include_usage else {})

            def chunk(piece: str | None, finish: str | None) -> dict:
                delta = {} if piece is None else {"content": piece}
                return {
                    **base,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                }

            first = chunk("", None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            usage = {**base, "choices": []} if include_usage else None
            return StreamingResponse(
                _stream(run, deadline, chunk, usage, first), media_type="text/event-stream"
            )
        text = await _unless_disconnected(request, _collect(run, deadline))
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": run.finish_reason}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": run.usage()}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: StarletteRequest):
        server.check_model(body.model)
        deadline = server.deadline()
        if body.echo:
            raise APIError(400, "echo is not supported yet", "echo")
        if body.logprobs is not None:
            raise APIError(400, "logprobs is not supported yet", "logprobs")
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts:
            raise APIError(400, "prompt is an empty list: give a string or a list of strings", "prompt")
        if body.stream and len(prompts) > 1:
            raise APIError(400, "streaming takes one prompt; this request gives a list", "prompt")
        batches = [await server.prompt(text, None, deadline) for text in prompts]
        params = [server.text_params(body, b.seq_len, body.max_tokens) for b in batches]
        runs: list[TextRun] = []
        try:
            for batch, p in zip(batches, params, strict=True):
                runs.append(server.run(batch, p))
        except APIError:
            for run in runs:
                run.close()
            raise
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": ident, "object": "text_completion", "created": created, "model": model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            base = head | ({"usage": None} if include_usage else {})

            def chunk(piece: str | None, finish: str | None) -> dict:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
                return {**base, "choices": [choice]}

            usage = {**base, "choices": []} if include_usage else None
            return StreamingResponse(
                _stream(runs[0], deadline, chunk, usage, None), media_type="text/event-stream"
            )
        try:
            texts = await _unless_disconnected(
                request, asyncio.gather(*(_collect(run, deadline) for run in runs))
            )
        finally:
            for run in runs:
                run.close()
        choices = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": run.finish_reason}
            for i, (text, run) in enumerate(zip(texts, runs, strict=True))
        ]
        usage = {
            k: sum(run.usage()[k] for run in runs)
            for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        }
        return {**head, "choices": choices, "usage": usage}

    @v1.post("/images/generations")
    async def images(body: ImageRequest) -> dict:
        if body.model is not None:
            server.check_model(body.model)
        deadline = server.deadline()
        if body.response_format == "url":
            raise APIError(
                400, "response_format 'url' is not supported: this server answers b64_json", "response_format"
            )
        if body.n > limits.max_images:
            raise APIError(
                400, f"n is {body.n}; this server draws at most {limits.max_images} images a request", "n"
            )
        side = pipe.spec.image_size
        if body.size not in (None, "auto", f"{side}x{side}"):
            raise APIError(400, f"size {body.size!r}: this model draws {side}x{side} images only", "size")
        data = []
        for i in range(body.n):
            seed = None if body.seed is None else body.seed + i

            def draw(seed: int | None = seed):
                return pipe(body.prompt, output="image", seed=seed)

            image = await server.job(draw, deadline)
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            data.append({"b64_json": base64.b64encode(buffer.getvalue()).decode("ascii")})
        return {"created": int(time.time()), "data": data}

    @v1.post("/audio/speech")
    async def speech(body: SpeechRequest) -> Response:
        server.check_model(body.model)
        deadline = server.deadline()
        if body.response_format not in ("wav", "flac"):
            raise APIError(
                400,
                f"response_format {body.response_format!r} is not supported yet: wav or flac",
                "response_format",
            )
        if body.speed != 1.0:
            raise APIError(400, "speed other than 1.0 is not supported yet", "speed")
        if body.instructions is not None:
            raise APIError(400, "instructions are not supported yet: the model has one voice", "instructions")

        def speak():
            return pipe(body.input, output="speech", max_audio_frames=limits.max_audio_frames, seed=body.seed)

        spoken = await server.job(speak, deadline)
        buffer = io.BytesIO()
        fmt = body.response_format.upper()
        sf.write(buffer, spoken.wave, spoken.sample_rate, format=fmt, subtype="PCM_16")
        return Response(buffer.getvalue(), media_type=f"audio/{body.response_format}")

    @v1.post("/audio/transcriptions")
    async def transcriptions(
        request: StarletteRequest,
        file: Annotated[UploadFile, File()],
        model: Annotated[str, Form()],
        prompt: Annotated[str | None, Form()] = None,
        response_format: Annotated[str, Form()] = "json",
        temperature: Annotated[float, Form(ge=0.0, le=2.0)] = 0.0,
        language: Annotated[str | None, Form()] = None,
    ):
        server.check_model(model)
        deadline = server.deadline()
        if response_format not in ("json", "text"):
            raise APIError(
                400,
                f"response_format {response_format!r} is not supported yet: json or text",
                "response_format",
            )
        if language is not None:
            raise APIError(
                400, "language is not supported yet: the model reads the speech it was trained on", "language"
            )
        media = limits.media
        raw = await file.read(media.max_audio_bytes + 1)
        if len(raw) > media.max_audio_bytes:
            raise APIError(
                413, f"the file is over {media.max_audio_bytes:,} bytes, this server's limit", "file"
            )
        try:
            check_audio_length(raw, "file", media)
        except ChatError as error:
            raise APIError(error.status, str(error), "file") from None
        batch = await server.prompt(prompt or "", MediaPart("audio", raw, "file"), deadline)
        body = Sampling(model=model, temperature=temperature)
        run = server.run(batch, server.text_params(body, batch.seq_len, None))
        text = await _unless_disconnected(request, _collect(run, deadline))
        return PlainTextResponse(text) if response_format == "text" else {"text": text}

    app.include_router(v1)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
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
