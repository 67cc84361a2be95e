"""The server's continuous-batching engine (`zoo.serve.engine`): concurrent requests share decode steps and
each still gets exactly the tokens it gets alone; seeds are per request; aborts and the queue limit free
and refuse slots. The model is the tiny untrained one of tests/test_pipeline.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from code_shard_helpers import unified_model, write_text_tokenizer, write_tokenizers

from zoo.inference import Pipeline
from zoo.serve.engine import Engine, Event, Finished, QueueFull, Request, Token
from zoo.tokenizers.text import TextTokenizer

TEXTS = ["a small red circle at the top left", "a large blue square", "two green triangles", "café naïve"]


def tiny_pipeline(folder: Path) -> Pipeline:
    model = unified_model(write_tokenizers(folder / "tokenizers"))
    tokenizer = TextTokenizer.load(write_text_tokenizer(folder / "tokenizer.json", TEXTS))
    return Pipeline(model.eval(), tokenizer)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory) -> Pipeline:
    return tiny_pipeline(tmp_path_factory.mktemp("engine"))


class Collector:
    """A request's events as the engine pushes them (on its thread)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, Finished):
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e.id for e in self.events if isinstance(e, Token)]

    @property
    def finished(self) -> Finished:
        assert self.done.wait(30), "the request never finished"
        return self.events[-1]

    def text(self, pipe: Pipeline) -> str:
        pieces = pipe.text_pieces()
        return "".join(pieces.add(t) for t in self.tokens) + pieces.rest()


def request(pipe: Pipeline, text: str, max_tokens: int, **sampling) -> tuple[Request, Collector]:
    collector = Collector()
    eos = pipe.model.vocab.eos_id
    return Request(pipe.prompt_batch(text), max_tokens, collector, stop_ids=(eos,), **sampling), collector


def wait_until(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def test_concurrent_greedy_requests_share_decode_steps_and_each_gets_its_answer_alone(pipe):
    prompts = {"a small red": 24, "two green triangles": 16, "a large": 20}
    alone = {text: "".join(pipe.stream(text, max_new_tokens=n, temperature=0)) for text, n in prompts.items()}
    engine = Engine(pipe.model, max_batch=4).start()
    try:
        first, *rest = prompts.items()
        runs = {first[0]: request(pipe, first[0], first[1], temperature=0)}
        engine.submit(runs[first[0]][0])
        wait_until(lambda: len(runs[first[0]][1].tokens) >= 3)  # the others join a batch already decoding
        for text, n in rest:
            runs[text] = request(pipe, text, n, temperature=0)
            engine.submit(runs[text][0])
        for text, (_, collector) in runs.items():
            finished = collector.finished
            assert collector.text(pipe) == alone[text]
            assert finished.completion_tokens == len(collector.tokens)
            assert finished.prompt_tokens == pipe.prompt_batch(text).seq_len
        assert engine.stats.decode_steps < sum(len(c.tokens) for _, c in runs.values())
        assert engine.stats.row_steps > engine.stats.decode_steps, "no step ever ran two rows"
        wait_until(lambda: engine.active == 0)
    finally:
        engine.stop()


def test_a_seeded_request_samples_the_same_tokens_alone_and_among_others(pipe):
    alone = "".join(pipe.stream("a large blue", max_new_tokens=12, temperature=1.0, seed=7))
    engine = Engine(pipe.model, max_batch=4)
    seeded, collector = request(pipe, "a large blue", 12, temperature=1.0, seed=7)
    others = [request(pipe, "two green", 12, temperature=1.0, seed=1), request(pipe, "two green", 12)]
    for r, _ in [others[0], (seeded, collector), others[1]]:
        engine.submit(r)
    engine.start()  # all three admitted together, the seeded one in the middle row, one row unseeded
    try:
        assert collector.finished.reason == "length"
        assert collector.text(pipe) == alone
        assert {tuple(c.tokens) for _, c in others} != {tuple(collector.tokens)}
    finally:
        engine.stop()


def test_an_aborted_request_frees_its_slot_for_the_next(pipe):
    engine = Engine(pipe.model, max_batch=1, max_queue=1).start()
    try:
        long, long_events = request(pipe, "a small", 400, temperature=0)
        engine.submit(long)
        wait_until(lambda: len(long_events.tokens) >= 2)
        queued, queued_events = request(pipe, "two", 5, temperature=0)
        engine.submit(queued)
        assert engine.active == 2
        engine.abort(long.id)
        assert long_events.finished.reason == "abort" and len(long_events.tokens) < 400
        assert queued_events.finished.reason == "length" and len(queued_events.tokens) == 5
        wait_until(lambda: engine.active == 0)
    finally:
        engine.stop()


def test_past_the_batch_and_the_queue_submit_raises_queue_full(pipe):
    engine = Engine(pipe.model, max_batch=1, max_queue=1)  # not started: nothing leaves
    engine.submit(request(pipe, "a", 4)[0])
    engine.submit(request(pipe, "b", 4)[0])
    with pytest.raises(QueueFull, match="max_batch 1 \\+ max_queue 1"):
        engine.submit(request(pipe, "c", 4)[0])
    waiting = request(pipe, "d", 4)
    engine.stop()
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        engine.submit(Request(waiting[0].prompt, 0, waiting[1]))
    with pytest.raises(ValueError, match="up to 512 positions .* got 1 row\\(s\\) of 2 \\+ 511"):
        engine.submit(Request(waiting[0].prompt, 511, waiting[1]))


def test_jobs_run_on_the_engine_thread_between_steps_and_return_their_errors(pipe):
    engine = Engine(pipe.model).start()
    try:
        assert engine.call(lambda: threading.current_thread().name).result(10) == "zoo-serve-engine"
        with pytest.raises(ValueError, match="needs a caption"):
            engine.call(lambda: pipe("", output="image")).result(10)
    finally:
        engine.stop()
