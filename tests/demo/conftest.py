"""The demo tests' shared run: SMALL served once per session through the counting seam."""

import pytest

from tests.demo.common import SMALL, Counting


@pytest.fixture(scope="session")
def served():
    """(DemoResult, Counting seam) of SMALL on the reference backend; read-only for the tests using it."""
    pytest.importorskip("transformers")
    from mstar_attn.demo import run_demo

    attn = Counting()
    return run_demo(SMALL, attention=attn), attn
