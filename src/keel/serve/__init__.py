"""`keel serve`: the policy behind an OpenAI-compatible HTTP API.

One `BatchingQueue` (batching.py) feeds one `RolloutEngine` through a `GenerationRunner`
(generation.py); `ServedPolicy` (policy.py) holds them with the tokenizer and the metrics; the
FastAPI app (app.py) is one front end of the queue, and a gRPC servicer or a score endpoint
would be others. FastAPI and uvicorn are imported in this package only.
"""
