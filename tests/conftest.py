"""Fixtures the test modules share, and hypothesis' profiles."""

import pytest
from hypothesis import settings

from flexpage import zoo

# The suite's property tests draw the same examples in every run (a red CI then means a change
# broke something, not that a new example turned up); ``pytest --hypothesis-profile=explore`` draws
# fresh ones, as a search for new failures should.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("repeatable")


@pytest.fixture(scope="session")
def stock_llama():
    """The stock tiny Llama (seeded random weights), the reference the paged paths are checked
    against; tests only call its ``generate()`` (never wrap it)."""
    return zoo.build("llama-tiny")
