"""DataError: a dataset that cannot be read. Its own module so that every reader of keel.data
(files, saved datasets, conversations, encoding) raises it without importing another reader."""

from __future__ import annotations


class DataError(ValueError):
    """A dataset that cannot be read; the message names the file and the line or row."""
