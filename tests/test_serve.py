"""`zoo serve` as an OpenAI client sees it: a real uvicorn server on a free local port, talked to with the
official `openai` SDK (and raw HTTP where the SDK would not send a malformed body).

The model is the tiny untrained one of tests/test_pipeline.py: answers are arbitrary, so every answer is
checked against what `Pipeline` says for the same prompt (the server must answer exactly that).
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import numpy as np
import openai
import pytest
import soundfile as sf
import torch
import uvicorn
from code_shard_helpers import audio_bytes, image_bytes
from PIL import Image
from ports import free_port
from test_serve_engine import tiny_pipeline

from zoo.hub import save_pretrained
from zoo.inference import Pipeline
from zoo.models.decode import text_prompts
from zoo.serve.app import ServeLimits, create_app
from zoo.serve.chat import MediaLimits
from zoo.serve.command import model_name

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"


class Running:
    """A uvicorn server in a thread of this process, its app and an `openai` client for it."""

    def __init__(self, app, api_key: str = "unused") -> None:
        self.app, self.port = app, free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=30)

    @property
    def engine(self):
        return self.app.state.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory) -> Pipeline:
    return tiny_pipeline(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def served(pipe) -> Iterator[Running]:
    running = Running(create_app(pipe, MODEL, max_batch=4, max_queue=4))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def strict(pipe) -> Iterator[Running]:
    """One slot, no queue, an API key and a small image limit."""
    limits = ServeLimits(media=MediaLimits(max_image_bytes=2000, max_audio_seconds=1.0))
    running = Running(create_app(pipe, MODEL, max_batch=1, max_queue=0, limits=limits, api_key="k3y"), "k3y")
    yield running
    running.stop()


def wait_until(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def user(*content) -> list[dict]:
    """One user message: a string, or content parts."""
    single = len(content) == 1 and isinstance(content[0], str)
    return [{"role": "user", "content": content[0] if single else list(content)}]


def data_url(png: bytes) -> dict:
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()},
    }


# -- answers ------------------------------------------------------------------------------------------------
def test_health_and_models_name_the_served_model(served):
    assert httpx2.get(served.url + "/health").json()["status"] == "ok"
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    assert served.client.models.retrieve(MODEL).owned_by == "zoo"


def test_chat_streams_pieces_that_join_to_the_greedy_answer_with_usage(served, pipe):
    expected = pipe("a small red", max_new_tokens=12, temperature=0)
    whole = served.client.chat.completions.create(
        model=MODEL, messages=user("a small red"), max_tokens=12, temperature=0
    )
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    prompt_tokens = pipe.prompt_batch("a small red").seq_len
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 12)
    assert whole.usage.total_tokens == prompt_tokens + 12

    chunks = list(
        served.client.chat.completions.create(
            model=MODEL, messages=user("a small red"), max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    *content, last, usage = chunks
    pieces = [c.choices[0].delta.content for c in content if c.choices[0].delta.content]
    assert "".join(pieces) == expected and len(pieces) >= 2, "streamed in pieces, joined to the answer"
    assert last.choices[0].finish_reason == "length" and all(c.usage is None for c in content)
    assert usage.choices == [] and usage.usage.completion_tokens == 12


def test_a_stop_string_ends_the_answer_before_it(served, pipe):
    full = pipe("two green", max_new_tokens=20, temperature=0)
    stop = full[5:8]
    assert stop and full.index(stop) >= 1
    answer = served.client.chat.completions.create(
        model=MODEL, messages=user("two green"), max_tokens=20, temperature=0, stop=[stop]
    )
    assert answer.choices[0].message.content == full[: full.index(stop)]
    assert answer.choices[0].finish_reason == "stop"


def test_completions_continue_the_prompt_and_echo_scores_it(served, pipe):
    answer = served.client.completions.create(model=MODEL, prompt="a large", max_tokens=8, temperature=0)
    assert answer.choices[0].text == pipe("a large", max_new_tokens=8, temperature=0)
    assert answer.usage.completion_tokens == 8
    ids = httpx2.post(served.url + "/tokenize", json={"prompt": "a large<eos>", "add_special_tokens": False})
    tokens = ids.json()["tokens"]
    vocab = pipe.model.vocab
    assert tokens[-1] == vocab.eos_id and tokens[:-1] == pipe.maker.ids("a large"), "<eos> is its id"
    text = httpx2.post(served.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "a large"
    assert httpx2.get(served.url + "/tokenizer_info").json()["eos_token"] == "<eos>"

    scored = served.client.completions.create(
        model=MODEL, prompt=tokens[:-1], max_tokens=1, temperature=0, echo=True, logprobs=2
    ).choices[0]
    # Every sent token is scored after the <bos> the server puts first, then one greedy token.
    model = pipe.model
    with torch.no_grad():
        hidden = model.forward_hidden(text_prompts(model, [[vocab.bos_id, *tokens[:-1]]])).hidden[0]
        reference = torch.log_softmax(model.sampling_logits(hidden).float(), -1)
    expected = reference[:-1].gather(-1, torch.tensor(tokens[:-1])[:, None])[:, 0].tolist()
    assert scored.logprobs.token_logprobs[:-1] == pytest.approx(expected, abs=1e-5)
    assert scored.logprobs.token_logprobs[-1] == pytest.approx(float(reference[-1].max()), abs=1e-5)
    assert all(len(top) <= 2 for top in scored.logprobs.top_logprobs)
    assert scored.text.startswith("a large") and len(scored.logprobs.tokens) == len(tokens)
    with pytest.raises(openai.BadRequestError, match="logprobs without echo"):
        served.client.completions.create(model=MODEL, prompt="a large", max_tokens=1, logprobs=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be 1"):
        served.client.completions.create(model=MODEL, prompt="a", max_tokens=3, echo=True, logprobs=1)


def test_image_and_audio_parts_are_read_as_the_pipeline_reads_them(served, pipe):
    png, wav = image_bytes(3), audio_bytes(1)
    chat = served.client.chat.completions.create
    answer = chat(model=MODEL, messages=user({"type": "text", "text": "Describe:"}, data_url(png)),
                  max_tokens=6, temperature=0)  # fmt: skip
    assert answer.choices[0].message.content == pipe("Describe:", image=png, max_new_tokens=6, temperature=0)
    assert answer.usage.prompt_tokens == pipe.prompt_batch("Describe:", image=png).seq_len
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    answer = chat(model=MODEL, messages=user(audio), max_tokens=6, temperature=0)
    assert answer.choices[0].message.content == pipe(audio=wav, max_new_tokens=6, temperature=0)
    transcript = served.client.audio.transcriptions.create(model=MODEL, file=("a.wav", wav), temperature=0)
    assert transcript.text == pipe(audio=wav, max_new_tokens=256, temperature=0)


def test_image_generation_answers_b64_pngs_and_speech_answers_wav_bytes(served, pipe):
    images = served.client.images.generate(model=MODEL, prompt="a small red circle", n=2)
    assert len(images.data) == 2
    for item in images.data:
        image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
        assert image.format == "PNG" and image.size == (32, 32)
    speech = served.client.audio.speech.create(
        model=MODEL, input="a red circle", voice="alloy", response_format="wav"
    )
    wave, rate = sf.read(io.BytesIO(speech.content), dtype="float32")
    assert rate == pipe.model.audio_codec.sample_rate and wave.ndim == 1 and np.isfinite(wave).all()
    with pytest.raises(openai.BadRequestError, match="draws at most 4 images"):
        served.client.images.generate(model=MODEL, prompt="a circle", n=5)


def test_best_of_is_the_pipelines_best_of_n_and_has_a_limit(served, pipe):
    best = {"best_of": 3, "seed": 7}  # not OpenAI's fields: the client sends them as extra body
    images = served.client.images.generate(model=MODEL, prompt="a small red circle", extra_body=best)
    drawn = Image.open(io.BytesIO(base64.b64decode(images.data[0].b64_json)))
    expected = pipe("a small red circle", output="image", seed=7, best_of=3)
    assert np.array_equal(np.asarray(drawn), np.asarray(expected))
    speech = served.client.audio.speech.create(
        model=MODEL, input="a red circle", voice="alloy", response_format="wav",
        extra_body={"best_of": 2, "seed": 1},
    )
    wave, _ = sf.read(io.BytesIO(speech.content), dtype="float32")
    spoken = pipe("a red circle", output="speech", seed=1, best_of=2, max_audio_frames=160)
    assert len(wave) == len(spoken.wave)
    with pytest.raises(openai.BadRequestError, match="draws at most 16 a request"):
        served.client.images.generate(model=MODEL, prompt="a circle", extra_body={"best_of": 17})


# -- errors ---------------------------------------------------------------------------------------------
def test_malformed_requests_are_400s_in_the_openai_envelope(served):
    raw = httpx2.post(
        served.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "json_invalid"
    missing = httpx2.post(served.url + "/v1/chat/completions", json={"model": MODEL})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
    chat = served.client.chat.completions.create
    with pytest.raises(openai.BadRequestError, match="unsupported parameter 'logprobs'"):
        chat(model=MODEL, messages=user("hi"), logprobs=True)
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\]: .*video_url"):
        chat(model=MODEL, messages=user(video))
    with pytest.raises(openai.BadRequestError, match="only data URLs"):
        chat(model=MODEL, messages=user({"type": "image_url", "image_url": {"url": "http://x/y.png"}}))
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\]"):
        chat(model=MODEL, messages=user(data_url(b"not an image")), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at most one image or audio a conversation"):
        chat(model=MODEL, messages=user(data_url(image_bytes(1)), data_url(image_bytes(2))))


def test_unknown_model_is_404_and_too_many_tokens_are_400s_naming_the_limits(served, pipe):
    with pytest.raises(openai.NotFoundError, match="this server serves 'tiny'"):
        served.client.chat.completions.create(model="gpt-7", messages=user("hi"))
    with pytest.raises(openai.BadRequestError, match="max_tokens is 1000; this server allows at most 256"):
        served.client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=1000)
    long = "a small red circle at the top left " * 40
    tokens = pipe.prompt_batch(long).seq_len
    assert tokens + 256 > 512
    with pytest.raises(openai.BadRequestError, match=f"the prompt takes {tokens} tokens .* context of 512"):
        served.client.completions.create(model=MODEL, prompt=long, max_tokens=256)


def test_a_full_server_answers_429_with_retry_after_and_a_disconnect_frees_the_slot(strict):
    client, engine = strict.client, strict.engine
    before = engine.stats.tokens
    stream = client.chat.completions.create(
        model=MODEL, messages=user("a small"), max_tokens=256, stream=True, temperature=0
    )
    for _, chunk in zip(range(3), stream, strict=False):
        assert chunk.choices[0].finish_reason is None
    assert engine.active == 1
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=MODEL, messages=user("two"), max_tokens=4)
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.body["code"] == "queue_full"
    stream.close()  # the client goes away mid-stream
    wait_until(lambda: engine.active == 0)
    assert engine.stats.tokens - before < 256, "the generation ran on after its client left"
    assert client.chat.completions.create(model=MODEL, messages=user("two"), max_tokens=2).choices


def test_a_client_that_gives_up_on_a_non_streamed_answer_frees_its_slot(strict):
    engine, before = strict.engine, strict.engine.stats.tokens
    body = json.dumps({"model": MODEL, "messages": user("a small"), "max_tokens": 256, "temperature": 0})
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer k3y\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    url = httpx2.URL(strict.url)
    # A raw HTTP/1.1 client that hangs up once its answer is being generated: a client-side timeout would
    # race the tiny model, which can write all 256 tokens before the server hears of it.
    with socket.create_connection((url.host, url.port)) as connection:
        connection.sendall((head + body).encode())
        wait_until(lambda: engine.active == 1, seconds=10.0)
    wait_until(lambda: engine.active == 0)
    assert engine.stats.tokens - before < 256, "the generation ran on after its client left"


def test_past_the_request_timeout_a_request_is_a_504_and_its_generation_stops(pipe):
    running = Running(create_app(pipe, MODEL, limits=ServeLimits(request_timeout=0.05)))
    try:
        with pytest.raises(openai.APIStatusError, match="longer than the server's request timeout") as late:
            running.client.chat.completions.create(model=MODEL, messages=user("a small"), max_tokens=256)
        assert late.value.status_code == 504 and late.value.body["code"] == "timeout"
        wait_until(lambda: running.engine.active == 0)
        assert running.engine.stats.tokens < 256
    finally:
        running.stop()


def test_an_api_key_is_required_when_set_and_oversized_media_are_413(strict):
    anonymous = openai.OpenAI(base_url=strict.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    assert httpx2.get(strict.url + "/health").status_code == 200, "health needs no key"
    with pytest.raises(openai.APIStatusError, match="takes at most 2,000") as big:
        strict.client.chat.completions.create(
            model=MODEL, messages=user(data_url(image_bytes(0, size=(64, 64))))
        )
    assert big.value.status_code == 413
    wav = base64.b64encode(audio_bytes(0, seconds=1.5)).decode()
    long = {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}
    with pytest.raises(openai.BadRequestError, match="lasts 1.5 s; this server reads at most 1 s"):
        strict.client.chat.completions.create(model=MODEL, messages=user(long))


# -- the command -------------------------------------------------------------------------------------------
def test_zoo_serve_serves_an_exported_folder_until_terminated(pipe, tmp_path):
    folder = save_pretrained(pipe.model, tmp_path / "tiny-export", pipe.tokenizer)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "zoo.cli",
        "serve",
        str(folder),
        "--port",
        str(port),
        "--max-tokens",
        "16",
    ]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        startup = process.stdout.readline()
        assert f"model 'tiny-export' from {folder}" in startup and f"http://127.0.0.1:{port}/v1" in startup
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "zoo serve did not come up"
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx2.TransportError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(model="tiny-export", messages=user("a small"), temperature=0)
        assert answer.choices[0].message.content == pipe("a small", max_new_tokens=16, temperature=0)
    finally:
        process.terminate()
        process.wait(20)


def test_the_served_name_is_the_folders_the_checkpoints_run_or_the_hub_id(tmp_path):
    checkpoint = tmp_path / "runs" / "quickstart" / "latest" / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"")
    assert model_name(str(checkpoint)) == "quickstart"
    assert model_name(str(tmp_path / "runs") + "/") == "runs"
    assert model_name("you/zoo-tiny") == "you/zoo-tiny"
