"""Datasets: the built-in arithmetic task, JSONL/Parquet loading, and the seeded batch stream."""

from keel.data.arithmetic import arithmetic_splits
from keel.data.examples import Example
from keel.data.files import DataError, load_examples
from keel.data.stream import BatchStream

__all__ = ["BatchStream", "DataError", "Example", "arithmetic_splits", "load_examples"]
