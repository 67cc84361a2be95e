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
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import StreamingResponse
from starlette.requests import Request as StarletteRequest

from zoo.inference import Pipeline
from zoo.serve.engine import Engine
from zoo.serve.generation import TextRun
from zoo.serve.media_routes import add_media_routes
from zoo.serve.protocol import APIError, ChatRequest, CompletionRequest
from zoo.serve.scoring_routes import add_scoring_routes, score_completions
from zoo.serve.server import (
    ServeLimits,
    Server,
    add_error_handlers,
    collect,
    stream_events,
    unless_disconnected,
)

__all__ = ["ServeLimits", "create_app"]


def create_app(
    pipe: Pipeline,
    model_name: str,
    engine: Engine | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    limits: ServeLimits | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The app serving `pipe` as `model_name`. The engine (made with max_batch/max_queue unless given)
    starts with the app and stops with it."""
    engine = engine or Engine(pipe.model, max_batch=max_batch, max_queue=max_queue)
    limits = limits or ServeLimits()
    server = Server(pipe, model_name, engine, limits, api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title=f"zoo serve: {model_name}", lifespan=lifespan)
    app.state.server, app.state.engine = server, engine
    add_error_handlers(app)
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
                stream_events(run, deadline, chunk, usage, first), media_type="text/event-stream"
            )
        try:
            text = await unless_disconnected(request, collect(run, deadline))
        finally:
            run.close()  # a no-op unless the answer never began (cancelled before its first step)
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": run.finish_reason}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": run.usage()}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: StarletteRequest):
        server.check_model(body.model)
        deadline = server.deadline()
        prompts = completion_prompts(body.prompt)
        if body.echo or body.logprobs is not None:
            return await score_completions(server, body, prompts, model_name)
        if body.stream and len(prompts) > 1:
            raise APIError(400, "streaming takes one prompt; this request gives a list", "prompt")
        batches = [
            await server.prompt(p, None, deadline) if isinstance(p, str) else server.ids_prompt(p)
            for p in prompts
        ]
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
                stream_events(runs[0], deadline, chunk, usage, None), media_type="text/event-stream"
            )
        try:
            texts = await unless_disconnected(
                request, asyncio.gather(*(collect(run, deadline) for run in runs))
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

    add_media_routes(v1, server)
    app.include_router(v1)
    add_scoring_routes(app, server)
    return app


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completions request: texts, or unified token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is an empty list: give a string, strings or token ids", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
