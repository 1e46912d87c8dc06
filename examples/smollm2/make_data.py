"""The data of examples/smollm2/grpo_smollm2.yaml: single-digit arithmetic chat prompts.

Every problem a + b, a - b (a ≥ b) and a * b with a, b in 0-9 (255 in all), each a chat prompt
with the one-line system message "Answer with only the number." (SmolLM2's template would
otherwise add its own, longer one) and its answer: `What is 7 * 8?` → `56`. A fixed, seeded
100 are held out (eval.jsonl), the other 155 are for training (train.jsonl); no problem is in
both. The same rows as `keel demo --model smollm2` (keel.cli.demo.smollm2_split).

    python examples/smollm2/make_data.py              # → examples/smollm2/{train,eval}.jsonl
    python examples/smollm2/make_data.py --out DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

from keel.cli.demo import smollm2_split, write_rows


def main() -> None:
    parser = argparse.ArgumentParser(description="write the SmolLM2 recipe's train/eval JSONL")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    train, held = smollm2_split()
    write_rows(args.out / "train.jsonl", train)
    write_rows(args.out / "eval.jsonl", held)
    print(
        f"{args.out / 'train.jsonl'}: {len(train)} problems, {args.out / 'eval.jsonl'}: {len(held)}"
    )


if __name__ == "__main__":
    main()
