"""Shared fixtures for the model tests: offline HF hub and one tiny model folder per session."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest

from keel.models import create_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model folder written once by create_tiny_model; tests must not modify it."""
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
