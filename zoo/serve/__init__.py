"""Serving a trained model over HTTP: `zoo serve` (issue 16, item 4), an OpenAI-compatible API.

`engine.Engine` batches concurrent text requests continuously on one thread; `app.create_app` is the FastAPI
app in front of it; `chat` lays a conversation out as a prompt (a provisional rule until the vocabulary has
chat roles).
"""
