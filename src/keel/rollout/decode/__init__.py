"""Keel's own decode engine for HF models: the `Decoder` seam (`keel.rollout.protocol`) on a
reserved KV cache, which the HF rollout engine's `generate_ids` and `keel serve`'s continuous
batching both drive.

The batch. One cache per layer, [L, H, capacity, D] (`kvcache.ReservedLayer`),
whose first T positions are filled; every row's tokens end at column T (left padding before
the row's first column, `start`), so one decode step writes one column for every row. A row's
next position is its token count, T − start: where a row sits in the cache never changes what
it computes (keys carry their rotary position from the moment they are written).

Joining. Rows that join are prefilled in a cache of their own (as `generate` prefills: the
whole prompt, or with `share_prefill` every distinct prompt but its last token once, repeated
for its adjacent copies, then the last tokens of all rows), which gives their first token's
logits. Their first token is sampled in the next `step`, beside the running rows' next one;
then the two caches are merged, right-aligned at the new T: the running rows are not
recomputed.

Leaving. A row that finishes (an EOS id, or its max_new_tokens) or leaves is free at once: its
tokens are no longer returned and it no longer counts as live. Its cache rows are dropped at
the next rebuild of the batch — a join, or a quarter of the batch finished — so the forward
runs over live rows only, give or take that quarter; a rebuild also drops the columns no live
row uses (the batch of a long-running server does not grow with its uptime).

Sampling (`sampling.py`) is `generate`'s, its noise drawn as `generate` draws it, so the same
seed gives the same tokens (tested). Every step has one host sync: the count of rows that
finished. Which models the loop runs: `generation_config.py` (`decodes`); the others keep HF
`generate`.

The files: `decoder.py` (`HFDecoder`: the step API, prefill, one step, the batch rebuilt),
`rollout_loop.py` (`RolloutDecoder`: a rollout chunk run to its end, weights swapped between
steps), `rows.py` (the rows' state), `sampling.py`, `generation_config.py`, `kvcache.py` (the
reserved KV cache and its row moves), `graphs.py` (the decode step at fixed shapes, a CUDA
graph on CUDA).
"""

from keel.rollout.decode.decoder import HFDecoder, compiled_forward
from keel.rollout.decode.generation_config import decodes
from keel.rollout.decode.rollout_loop import RolloutDecoder

__all__ = ["HFDecoder", "RolloutDecoder", "compiled_forward", "decodes"]
