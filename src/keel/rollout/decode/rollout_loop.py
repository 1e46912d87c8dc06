"""The rollout's decode loop: every row joined at once and run to its end (`decode`), an
interruptible rollout's new weights taken between steps, the running rows' KV cache then
computed again under them (`_reprefill`). `HFRolloutEngine.generate_ids` drives it; serving
drives `HFDecoder`'s step API."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from keel.rollout.decode.decoder import HFDecoder
from keel.rollout.decode.kvcache import RESERVED_NEW_TOKENS, reserved_cache
from keel.rollout.decode.rows import padding_mask
from keel.rollout.protocol import RowRequest


class RolloutDecoder(HFDecoder):
    """An `HFDecoder` that also runs a whole rollout chunk (`decode`): the rollout's parity with
    `generate` takes `noise_rows` = the chunk's rows."""

    def decode(
        self, rows: Sequence[RowRequest], at_step: Callable[[int], int] | None = None
    ) -> tuple[list[list[int]], list[list[float]], list[int] | None]:
        """Every row to its end, all joined at once: each row's tokens (up to its first EOS id,
        which is included, or its max_new_tokens; a row may run on past its EOS by a few
        tokens, which `cut_completions` drops), their log-probs, and the weight version of
        each step (None without `at_step`). Synced (FSDP2): steps until every rank's rows are
        done.

        at_step(i) is called before the step that samples each row's token i (i = 0 before
        the prefill) and returns the weight version the step samples under; it may load new
        weights into the model first (an interruptible rollout's weight push,
        `keel.workers.rollout`). When the version changes, the live rows' cache is computed
        again under the new weights (`_reprefill`: prompt and tokens so far), so every token
        is sampled from the distribution of the version recorded for it, and its log-prob is
        that version's."""
        longest = max(row.sampling.max_new_tokens for row in rows)
        tokens = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
        logps = torch.zeros((len(rows), longest))
        versions: list[int] = []
        version = self._version_at(at_step, 0)
        with self._mode():
            self.joined.append(self._prefill(rows))
            self._live += len(rows)
            steps = 0
            while steps < longest and self._any_live():
                if at_step is not None and steps:
                    now = self._version_at(at_step, steps)
                    if now != version:
                        self._reprefill(rows, tokens, steps)
                    version = now
                versions.append(version)
                _, alive, new, lp, _ = self._advance()
                # noise_index: each row's index in `rows` (one join); rows past their end
                # (an FSDP2 rank's ghost) are not written
                at = self.last_index[alive].cpu()
                tokens[at, steps] = new[alive].cpu()
                logps[at, steps] = lp[alive].float().cpu()
                steps += 1
        self._reset()
        return (
            tokens[:, :steps].tolist(),
            logps[:, :steps].tolist(),
            versions if at_step is not None else None,
        )

    @staticmethod
    def _version_at(at_step: Callable[[int], int] | None, step: int) -> int:
        """at_step(step) outside inference mode (it may load weights into the model)."""
        if at_step is None:
            return 0
        with torch.inference_mode(False), torch.no_grad():
            return int(at_step(step))

    def _reprefill(self, rows: Sequence[RowRequest], tokens: torch.Tensor, steps: int) -> None:
        """The running rows' cache computed again with the model's current weights: one
        prefill of each live row's prompt and its first `steps` − 1 tokens (its last token,
        `last`, is the next step's input, as after any step), right-aligned at the new T;
        finished rows are dropped. tokens [N, longest]: `decode`'s, by each row's index in
        `rows` (its noise_index). Draws no random numbers."""
        assert not self.joined, "rows joined since the last step"
        keep = self.rows.alive.nonzero().flatten()
        if not len(keep):
            return
        index = self.rows.noise_index[keep].cpu().tolist()
        prefixes = [list(rows[i].prompt_ids) + tokens[i, : steps - 1].tolist() for i in index]
        width = max(len(x) for x in prefixes)
        kept = self.rows.select(keep, [self.rows.keys[i] for i in keep.tolist()])
        room = min(int((kept.budget - kept.produced).max()), RESERVED_NEW_TOKENS)
        cache = reserved_cache(self.model.config, width + max(room, 1))
        kept.start = width - torch.tensor([len(x) for x in prefixes], device=self.device)
        ids = self._left_padded(prefixes, width)
        self._forward(ids, padding_mask(kept.start, width), cache)
        if self.running is not None:
            assert self.static is not None
            self.static.release(self.running, self)
            self.running = None  # dynamic steps until the next rebuild picks a bucket again
        self.cache, self.T, self.rows = cache, width, kept
        self._padded = bool((kept.start > 0).any())
