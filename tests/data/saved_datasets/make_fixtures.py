"""Writes the saved datasets next to this file with Hugging Face `datasets` (5.2.0). Keel reads
them with pyarrow alone and does not depend on `datasets`; this script is not run by the tests.

    pip install --target /tmp/dsenv --no-deps datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
        xxhash==4.1.0 pandas==3.1.1
    PYTHONPATH=/tmp/dsenv python tests/data/saved_datasets/make_fixtures.py
"""

from pathlib import Path

from datasets import Dataset, DatasetDict

HERE = Path(__file__).parent
CHAT = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]

if __name__ == "__main__":
    rows = {"prompt": ["1+1=", "2+3=", "4+4="], "answer": ["2", "5", "8"]}
    held_out = Dataset.from_dict({"prompt": ["9+0="], "answer": ["9"]})
    DatasetDict({"train": Dataset.from_dict(rows), "test": held_out}).save_to_disk(HERE / "dict")
    Dataset.from_dict({"messages": [CHAT, CHAT], "answer": ["2", "2"]}).save_to_disk(HERE / "chat")
    numbers = [str(i) for i in range(10)]
    Dataset.from_dict({"prompt": numbers, "answer": numbers}).save_to_disk(
        HERE / "sharded", num_shards=3
    )
