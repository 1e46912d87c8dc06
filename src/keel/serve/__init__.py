"""`keel serve`: the policy behind an OpenAI-compatible HTTP API.

One `BatchingQueue` (batching.py) feeds one `RolloutEngine` through a `GenerationRunner`
(generation.py); `ServedPolicy` (policy.py) holds them with the tokenizer and the metrics; the
FastAPI app (app.py) and the gRPC servicer (grpc_server.py) are the front ends of the queue.
With `--reward`, `ServedReward` (scoring.py) holds a reward model and its queue instead, behind
/v1/score and gRPC Score. FastAPI, uvicorn and grpcio are imported in this package only.
"""
