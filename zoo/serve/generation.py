"""One text request in flight, as the event loop sees it: tokens from the engine thread in, text pieces out.

The engine pushes each event with `loop.call_soon_threadsafe` into the request's own `asyncio.Queue`; the
handler reads them as text pieces that never split a character (`Pipeline.text_pieces`), holds back what
could be the start of a stop string, and aborts the engine's row when it stops early, times out or the
client goes away (the `finally` of `pieces`, and `close` for the SSE generators that wrap it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from zoo.batch import GroupBatch
from zoo.inference import Pipeline
from zoo.serve.engine import Engine, Event, QueueFull, Request, Token
from zoo.serve.protocol import APIError


@dataclass(frozen=True)
class TextParams:
    """A text request's settings, checked (`app.Server.text_params`)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()


class StopStrings:
    """Text pieces in, text out up to (not including) the first stop string; what might be the start of
    one is held back until the next piece tells."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.text, self.sent = stops, "", 0

    def push(self, piece: str) -> tuple[str, bool]:
        """The text that may be sent now, and whether a stop string was met."""
        self.text += piece
        hits = [at for stop in self.stops if (at := self.text.find(stop, max(self.sent - len(stop), 0))) >= 0]
        if hits:
            cut = min(hits)
            out, self.sent = self.text[self.sent : cut], cut
            return out, True
        held = max(
            (k for stop in self.stops for k in range(1, len(stop)) if self.text.endswith(stop[:k])), default=0
        )
        end = max(len(self.text) - held, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


class TextRun:
    """A request submitted to the engine (QueueFull -> 429 with Retry-After), read with `pieces`."""

    def __init__(
        self, engine: Engine, pipe: Pipeline, prompt: GroupBatch, params: TextParams, retry_after_s: int
    ) -> None:
        self.engine, self.pipe, self.params = engine, pipe, params
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.prompt_tokens, self.completion_tokens = prompt.seq_len, 0
        self.finish_reason: str | None = None
        self.done = False
        request = Request(
            prompt, params.max_tokens, self._emit, params.temperature, params.top_k, params.top_p,
            params.seed, (pipe.model.vocab.eos_id,),
        )  # fmt: skip
        try:
            self.id = engine.submit(request)
        except QueueFull as error:
            raise APIError(
                429, f"the server is busy: {error}; retry later", code="queue_full", kind="rate_limit_error",
                headers={"Retry-After": str(retry_after_s)},
            ) from None  # fmt: skip

    def _emit(self, event: Event) -> None:  # on the engine thread
        if not self.loop.is_closed():  # a server shutting down: no one is left to read it
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def close(self) -> None:
        """Free the engine's row unless the request already ended there."""
        if not self.done:
            self.done = True
            self.engine.abort(self.id)

    async def pieces(self, deadline: float) -> AsyncIterator[str]:
        """The answer's text pieces until it ends (`finish_reason` "stop" or "length"); APIError 504 past
        `deadline` (the loop's clock), 500 when the engine failed."""
        text, stops = self.pipe.text_pieces(), StopStrings(self.params.stop)
        try:
            while True:
                event = await self._next(deadline)
                if isinstance(event, Token):
                    self.completion_tokens += 1
                    out, hit = stops.push(text.add(event.id))
                    if out:
                        yield out
                    if hit:
                        self.finish_reason = "stop"
                        return
                    continue
                self.done = True
                if event.reason in ("error", "abort"):
                    message = event.error or "the request was cancelled by the server"
                    raise APIError(500, message, kind="server_error", code=event.reason)
                out, hit = stops.push(text.rest())
                out += "" if hit else stops.flush()
                if out:
                    yield out
                self.finish_reason = "stop" if hit else event.reason
                return
        finally:
            self.close()

    async def _next(self, deadline: float) -> Event:
        left = deadline - self.loop.time()
        try:
            return await asyncio.wait_for(self.queue.get(), max(left, 0.0))
        except TimeoutError:
            raise APIError(
                504, "the request took longer than the server's request timeout", code="timeout",
                kind="timeout_error",
            ) from None  # fmt: skip

    def usage(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
        }
