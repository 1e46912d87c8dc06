"""What every RolloutEngine must do (HF and vLLM engines run the same checks): the Batch layout
of the protocol, finish reasons, chat prompts, new weights taking effect, an idempotent close;
an interruptible engine's step hook recording each token's version.

`check_engine(engine, tokenizer, new_state)`: `engine` generates with some policy π; `new_state`
is a full state dict of a different policy (its greedy answers differ from π's)."""

from __future__ import annotations

import torch

from keel.data import Example
from keel.rollout import FINISH_REASONS, Completions, RolloutEngine, SamplingParams
from keel.rollout.protocol import InterruptibleEngine


def check_batch(batch, tokenizer, examples, sampling, group_offset):
    n = sampling.n
    assert len(batch) == len(examples) * n
    r = batch.response_length
    assert r <= sampling.max_new_tokens
    assert batch.input_ids.shape == batch.attention_mask.shape
    assert batch.input_ids.shape[1] == batch.prompt_length + r
    mask = batch.response_mask
    assert mask.dtype == torch.float32 and set(mask.unique().tolist()) <= {0.0, 1.0}
    assert batch.attention_mask[:, -r:].tolist() == mask.long().tolist()
    # the response mask is a prefix: ones, then zeros
    assert (mask[:, 1:] <= mask[:, :-1]).all()
    expected_groups = torch.arange(len(examples)).repeat_interleave(n) + group_offset
    assert batch.group_ids.tolist() == expected_groups.tolist()
    assert batch.prompts == [ex.prompt for ex in examples for _ in range(n)]
    assert batch.answers == [ex.answer for ex in examples for _ in range(n)]
    assert len(batch.responses) == len(batch) and len(batch.finish_reasons) == len(batch)
    eos = set(batch.meta["eos_token_ids"])
    response = batch.input_ids[:, -r:]
    for i, reason in enumerate(batch.finish_reasons):
        assert reason in FINISH_REASONS
        length = int(mask[i].sum())
        ended = length > 0 and int(response[i, length - 1]) in eos
        assert (reason == "stop") == ended, (i, reason, length)
        if reason == "length":
            assert length == sampling.max_new_tokens
        text = response[i, : length - 1 if ended else length].tolist()
        assert batch.responses[i] == tokenizer.decode(text, skip_special_tokens=True)
    if batch.rollout_logprobs is not None:
        lp = batch.rollout_logprobs
        assert lp.shape == mask.shape
        assert (lp[mask == 0] == 0).all() and (lp[mask == 1] <= 0).all()


def check_generate_ids(engine: RolloutEngine, batch, greedy: SamplingParams) -> None:
    """`generate_ids` from the batch's own prompt ids (greedy) gives its response tokens, and a
    continuation of a whole row (prompt + response, as a multi-turn episode continues) runs."""
    p = batch.prompt_length
    prompts = [
        row[mask.bool()].tolist()
        for row, mask in zip(batch.input_ids[:, :p], batch.attention_mask[:, :p], strict=True)
    ]
    done = engine.generate_ids(prompts[:: greedy.n], greedy)
    assert isinstance(done, Completions) and len(done.token_ids) == len(batch)
    for i, tokens in enumerate(done.token_ids):
        length = int(batch.response_mask[i].sum())
        assert tokens == batch.input_ids[i, p : p + length].tolist()
        assert done.finish_reasons[i] == batch.finish_reasons[i]
    if done.logprobs is not None:
        assert [len(x) for x in done.logprobs] == [len(t) for t in done.token_ids]
    more = engine.generate_ids([prompts[0] + done.token_ids[0]], SamplingParams(max_new_tokens=2))
    assert len(more.token_ids) == 1 and 1 <= len(more.token_ids[0]) <= 2
    if isinstance(engine, InterruptibleEngine) and engine.interruptible:
        # with a step hook (an interruptible rollout) that never changes the version: the
        # same greedy tokens, each recorded with the hook's version
        steps: list[int] = []
        engine.step_hook = lambda step: steps.append(step) or 5
        try:
            hooked = engine.generate_ids(prompts[:: greedy.n], greedy)
        finally:
            engine.step_hook = None
        assert hooked.token_ids == done.token_ids and steps[:2] == [0, 1]
        assert hooked.versions == [[5] * len(t) for t in done.token_ids]


def check_engine(engine: RolloutEngine, tokenizer, new_state: dict[str, torch.Tensor]) -> None:
    assert isinstance(engine, RolloutEngine)
    examples = [Example(prompt="3+4=", answer="7"), Example(prompt="12-5=", answer="7")]
    sampled = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=5)
    check_batch(engine.generate(examples, sampled, group_offset=6), tokenizer, examples, sampled, 6)
    chat = [Example(prompt=[{"role": "user", "content": "2+2="}], answer="4")]
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=4)
    batch = engine.generate(chat, greedy)
    check_batch(batch, tokenizer, chat, greedy, 0)
    assert batch.responses[0] == batch.responses[1]  # greedy: the group's rows agree
    plain = engine.generate(examples, greedy)
    before = plain.responses
    check_generate_ids(engine, plain, greedy)
    if not engine.shares_module:
        engine.update_weights(new_state, version=1)
        after = engine.generate(examples, greedy).responses
        assert after != before, "the new weights did not change the greedy answers"
    engine.sleep()
    engine.wake()
    assert engine.generate(examples, greedy).input_ids is not None
    engine.close()
    engine.close()
