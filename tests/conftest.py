"""Shared pytest fixtures. Helpers may append their own fixtures at the end of this file."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_family():
    """The tiny fixture family (dict: "tokenizer", "slm", "verifier", "assistant" -> Path).

    Generated once per machine into .cache/test-fixtures/<hash of the generator's sources>/,
    then reused; treat the folders as read-only (copy before editing a file).
    """
    from hyco.fixtures.cache import cached_family

    return cached_family("tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_family_distilled():
    """The tiny family after the default short CPU distillation (hyco/fixtures/distill.py): the
    drafters agree with the verifier on real text (figures in <family>/distill_report.json).

    Several minutes on first use per machine (cached like `tiny_family`); use it only where a
    test needs drafters that agree with the verifier (acceptance, end-to-end runtime checks).
    """
    from hyco.fixtures.cache import cached_family

    return cached_family("tiny", seed=0, distill=True)
