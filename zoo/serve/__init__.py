"""Serving a trained model over HTTP: `zoo serve` (issue 16, item 4), an OpenAI-compatible API.

- `engine`: `Engine`, continuous batching of concurrent text requests on one thread that owns the model;
- `app`: `create_app(pipeline, model_name, ...)`, the FastAPI app (text routes), with `media_routes`
  (images, speech, transcriptions), `server` (limits, checks, SSE, errors) and `generation` (one request's
  tokens read on the event loop);
- `protocol`: the OpenAI request bodies and the error envelope;
- `chat`: a conversation laid out as one prompt (a provisional rule until the vocabulary has chat roles);
- `command`: `zoo serve SOURCE` (uvicorn, one worker).
"""
