"""bench/compare_trl.py (`make bench-trl`): one interleaved Keel/TRL step of the smallest
workload on the tiny model with natural lengths, through main; its JSON line and tables read
back: the step times, the tokens each side computed and their padding, and the phase-vs-floor
figures. The forced-length model folder and the real-model variant's model and prompts are
checked without a step (a SmolLM2 step of both programs takes about a minute of CPU)."""

import json

import pytest
from bench.compare_trl import VARIANTS, main, model_folder

from tests.bench.smoke import json_lines, positive


def test_one_natural_length_step_reports_times_tokens_and_floors(capsys):
    main(["--model", "tiny", "--workloads", "W1", "--steps", "1", "--warmup", "0",
          "--lengths", "natural"])  # fmt: skip
    captured = capsys.readouterr()
    (row,) = json_lines(captured.out)
    assert (row["workload"], row["lengths"], row["model"]) == ("W1", "natural", "tiny")
    rows = 2 * 4
    for side in ("keel", "trl"):
        s = row[side]
        assert positive(s["wall_s"]) and positive(s["cpu_s"])
        assert 1 <= s["completion_len"] <= 8
        t = s["tokens"]
        lengths = row["rows"][side][0]  # (prompt, response) tokens of each row of the step
        assert len(lengths) == rows and all(p == 16 and 1 <= r <= 8 for p, r in lengths)
        assert t["tokens_present"] == sum(p + r for p, r in lengths)
        assert t["response_tokens"] == sum(r for _, r in lengths)
        assert t["response_tokens"] == pytest.approx(s["completion_len"] * rows)
        assert 0 <= t["gen_padding_frac"] < 1 and 0 <= t["train_padding_frac"] < 1
        floor = row["floor"][side]
        for phase in ("generate", "train"):
            assert positive(floor["floor_s"][phase]) and positive(floor["over_floor"][phase])
    # TRL's passes run every row's prompt; Keel's shared passes each group's once
    assert row["trl"]["tokens"]["train_computed"] >= rows * (16 + 1)
    assert row["keel"]["tokens"]["train_computed"] < row["trl"]["tokens"]["train_computed"]
    assert positive(row["ratio_cpu"]) and positive(row["ratio_cpu_per_token"])
    for table in ("phase vs matmul floor", "tokens per step", "CPU s per token present"):
        assert table in captured.err


def test_forced_lengths_suppress_the_eos_in_the_folder(tmp_path):
    folder, params = model_folder(tmp_path / "mini", "mini", forced=True)
    assert 600_000 < params < 700_000
    config = json.loads((folder / "generation_config.json").read_text())
    assert config["suppress_tokens"]  # every EOS id
    natural, _ = model_folder(tmp_path / "tiny", "tiny", forced=False)
    assert "suppress_tokens" not in json.loads((natural / "generation_config.json").read_text())


def test_real_variant_uses_the_cached_smollm2_and_its_prompts_fit(smollm2_dir, tmp_path):
    from keel.models import load_tokenizer

    variant = VARIANTS["real"]
    folder, params = model_folder(tmp_path / "real", variant.model, forced=False)
    assert folder == smollm2_dir and not (tmp_path / "real").exists()  # not copied, not changed
    assert 130e6 < params < 140e6
    tokenizer = load_tokenizer(folder)
    lengths = [len(tokenizer(p)["input_ids"]) for p in variant.prompts]
    assert max(lengths) <= variant.prompt_length and len(set(variant.prompts)) >= 4
