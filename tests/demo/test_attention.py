"""The attention seam: the reference one runs eagerly and has no graph half."""

import attrs
import pytest

pytest.importorskip("transformers")

from mstar_attn.demo import DemoError, StepAttention, run_demo  # noqa: E402
from tests.demo.common import SMALL  # noqa: E402


def test_reference_seam_cannot_capture():
    with pytest.raises(DemoError, match="--graphs needs a GPU backend"):
        run_demo(attrs.evolve(SMALL, graphs=True), attention=StepAttention("reference"))
