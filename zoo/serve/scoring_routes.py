"""What lm-eval's `local-completions` client needs of `zoo serve` (REFERENCES.md part D, section 6): the
tokenizer over HTTP (`/tokenize`, `/detokenize`, `/tokenizer_info`, vLLM's shapes, so lm-eval's
`tokenizer_backend=remote` needs no tokenizer file) and completions with `echo` + `logprobs`: the prompt's
own tokens scored, then one greedy token (`zoo.inference.scoring.score_sequences`, on the engine thread).

    lm_eval --model local-completions --model_args base_url=http://127.0.0.1:8000/v1/completions,\\
        model=NAME,tokenizer_backend=remote,tokenized_requests=True,max_length=512 --tasks ...

Token ids are the model's unified ids. A prompt that does not begin with `<bos>` is scored after one, as
every document of the model begins: its first token then has a log-prob (OpenAI gives None there).
"""

from __future__ import annotations

import time
import uuid

import torch
from fastapi import APIRouter, Depends, FastAPI
from pydantic import Field

from zoo.inference.scoring import score_sequences
from zoo.serve.protocol import APIError, Body, CompletionRequest
from zoo.serve.server import Server

Prompt = str | list[int]


class TokenizeRequest(Body):
    prompt: str
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(Body):
    tokens: list[int] = Field(min_length=0)
    model: str | None = None


def add_scoring_routes(app: FastAPI, server: Server) -> None:
    """`/tokenize`, `/detokenize` and `/tokenizer_info` at the root (as vLLM serves them), API key checked."""
    root = APIRouter(dependencies=[Depends(server.authorize)])
    pipe = server.pipe

    @root.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        if body.model is not None:
            server.check_model(body.model)
        tokens = pipe.tokenize(body.prompt, body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.context}

    @root.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        if body.model is not None:
            server.check_model(body.model)
        try:
            pipe.model.vocab.check_ids(torch.tensor(body.tokens, dtype=torch.long))
        except ValueError as error:
            raise APIError(400, str(error), "tokens") from None
        return {"prompt": pipe.detokenize(body.tokens)}

    @root.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return {
            "tokenizer_class": "zoo.tokenizers.text.TextTokenizer", "bos_token": "<bos>",
            "eos_token": "<eos>", "pad_token": "<pad>", "model_max_length": server.context,
            "vocab_size": pipe.model.vocab.size,
        }  # fmt: skip

    app.include_router(root)


def scoring_ids(server: Server, prompt: Prompt) -> list[int]:
    """A prompt's unified ids (a text tokenized as `/tokenize` does, without `<bos>`)."""
    return server.pipe.tokenize(prompt) if isinstance(prompt, str) else list(prompt)


async def score_completions(
    server: Server, body: CompletionRequest, prompts: list[Prompt], name: str
) -> dict:
    """A completions response for `echo` + `logprobs`: each prompt's tokens with their log-probs and top
    alternatives, then `max_tokens` (1) greedy token."""
    if not body.echo:
        raise APIError(400, "logprobs without echo is not supported yet: set echo to score a prompt", "echo")
    if body.stream:
        raise APIError(400, "echo with logprobs does not stream", "stream")
    if (body.max_tokens or 1) != 1:
        raise APIError(400, "echo scores the prompt and one next token: max_tokens must be 1", "max_tokens")
    if body.temperature not in (None, 0):
        raise APIError(400, "echo scores greedily: temperature must be 0", "temperature")
    vocab, top = server.pipe.model.vocab, max(body.logprobs or 0, 1)
    rows = [scoring_ids(server, p) for p in prompts]
    sequences = []
    for i, ids in enumerate(rows):
        try:
            sequences.append(server.pipe.with_bos(ids))
        except ValueError as error:
            raise APIError(400, f"prompt {i}: {error}", "prompt") from None
        if len(sequences[-1]) + 1 > server.context:  # the sequence and its one greedy token
            raise APIError(400, f"prompt {i} takes {len(ids)} tokens; the context is {server.context}",
                           "prompt", "context_length_exceeded")  # fmt: skip
    model = server.pipe.model
    scores = await server.job(
        lambda: score_sequences(model, sequences, top, with_next=True), server.deadline()
    )
    choices = []
    for i, (ids, sequence, scored) in enumerate(zip(rows, sequences, scores, strict=True)):
        added = len(sequence) - len(ids)  # 1 when <bos> was put first: every sent token is then scored
        token_ids = [*ids, scored.next_id]
        logprobs = [None] * (1 - added) + scored.logprobs + [scored.next_logprob]
        tops = [None] * (1 - added) + [
            {server.pipe.detokenize([t]): lp for t, lp in zip(top_ids, top_lps, strict=True)}
            for top_ids, top_lps in zip(scored.top_ids, scored.top_logprobs, strict=True)
        ] + [{server.pipe.detokenize([scored.next_id]): scored.next_logprob}]
        tokens = [server.pipe.detokenize([t]) for t in token_ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        logprob_block = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
                         "text_offset": offsets}  # fmt: skip
        finish = "stop" if scored.next_id == vocab.eos_id else "length"
        choice = {"index": i, "text": "".join(tokens), "logprobs": logprob_block, "finish_reason": finish}
        choices.append(choice)
    prompt_tokens = sum(len(ids) for ids in rows)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(rows),
             "total_tokens": prompt_tokens + len(rows)}  # fmt: skip
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": name, "choices": choices, "usage": usage}  # fmt: skip
