"""The media endpoints of `zoo serve`: `/v1/images/generations` (b64_json PNGs), `/v1/audio/speech` (WAV or
FLAC bytes) and `/v1/audio/transcriptions` (multipart upload, json or text). Media are generated whole on
the engine thread, between decode steps; a transcription is a text request like any other (batched).
"""

from __future__ import annotations

import base64
import io
import time
from typing import Annotated

import soundfile as sf
from fastapi import APIRouter, File, Form, UploadFile
from fastapi.responses import PlainTextResponse, Response
from starlette.requests import Request as StarletteRequest

from zoo.serve.chat import MediaPart, PartError, check_audio_length
from zoo.serve.protocol import APIError, ImageRequest, Sampling, SpeechRequest
from zoo.serve.server import Server, collect, unless_disconnected


def add_media_routes(v1: APIRouter, server: Server) -> None:
    """The media routes on `v1` (the `/v1` router with its API-key check)."""
    pipe, limits = server.pipe, server.limits

    def check_best_of(best_of: int) -> None:
        if best_of > limits.max_best_of:
            most = limits.max_best_of
            message = f"best_of is {best_of}; this server draws at most {most} a request"
            raise APIError(400, message, "best_of")

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
        check_best_of(body.best_of)
        side = pipe.spec.image_size
        if body.size not in (None, "auto", f"{side}x{side}"):
            raise APIError(400, f"size {body.size!r}: this model draws {side}x{side} images only", "size")
        data = []
        for i in range(body.n):
            seed = None if body.seed is None else body.seed + i

            def draw(seed: int | None = seed):
                return pipe(body.prompt, output="image", seed=seed, best_of=body.best_of)

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

        check_best_of(body.best_of)

        def speak():
            frames, seed = limits.max_audio_frames, body.seed
            return pipe(body.input, output="speech", max_audio_frames=frames, seed=seed, best_of=body.best_of)

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
        except PartError as error:
            raise APIError(error.status, str(error), "file") from None
        batch = await server.prompt(prompt or "", MediaPart("audio", raw, "file"), deadline)
        body = Sampling(model=model, temperature=temperature)
        run = server.run(batch, server.text_params(body, batch.seq_len, None))
        try:
            text = await unless_disconnected(request, collect(run, deadline))
        finally:
            run.close()
        return PlainTextResponse(text) if response_format == "text" else {"text": text}
