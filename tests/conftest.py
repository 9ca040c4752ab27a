"""Fixtures the test modules share."""

import pytest

from flexpage import zoo


@pytest.fixture(scope="session")
def stock_llama():
    """The stock tiny Llama (seeded random weights), the reference the paged paths are checked
    against; tests only call its ``generate()`` (never wrap it)."""
    return zoo.build("llama-tiny")
