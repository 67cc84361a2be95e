"""The OpenAI request bodies `zoo serve` accepts, and its error envelope.

Fields follow the `openai` SDK's request types (REFERENCES.md part D, section 4). An unknown field is
refused (400 naming it), not silently ignored: a client that asks for `logprobs`, `tools` or a penalty
learns that this server does not do it yet instead of getting an answer that quietly lacks it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered in OpenAI's envelope `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- chat ------------------------------------------------------------------------------------------------
class TextContent(Body):
    type: Literal["text"]
    text: str


class ImageURL(Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageContent(Body):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(Body):
    data: str
    format: Literal["wav", "mp3", "flac"]


class AudioContent(Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


Content = Annotated[TextContent | ImageContent | AudioContent, Field(discriminator="type")]


class Message(Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Content] | None = None
    name: str | None = None


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # padding against side channels: nothing to pad here


class Sampling(Body):
    """What chat and completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)  # not OpenAI's; vLLM's extra parameter
    n: int = Field(1, ge=1, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(Sampling):
    # A text, texts, unified token ids (`/tokenize`'s), or lists of them (lm-eval's tokenized requests).
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)


# -- media ------------------------------------------------------------------------------------------------
class ImageRequest(Body):
    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(1, ge=1)
    size: str | None = None
    response_format: Literal["b64_json", "url"] | None = None
    seed: int | None = None  # not OpenAI's: repeatable images
    best_of: int = Field(1, ge=1)  # not OpenAI's: the best of that many draws by the model's own reading
    user: str | None = None


class SpeechRequest(Body):
    model: str
    input: str = Field(min_length=1, max_length=4096)
    voice: str  # required by the API; the model has one voice, so any name reads it
    response_format: Literal["wav", "flac", "mp3", "opus", "aac", "pcm"] = "wav"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    instructions: str | None = None
    seed: int | None = None  # not OpenAI's: repeatable speech
    best_of: int = Field(1, ge=1)  # not OpenAI's: the best of that many draws by the model's own reading
