import pytest
import torch


@pytest.fixture(autouse=True)
def _dynamo_fails_instead_of_falling_back():
    """The GPU tests compile many small graphs (flex's ``score_mod`` per encoding, dtype and mask):
    a compiled function past dynamo's recompile limit would silently run eagerly, so the limit is
    raised and hitting it is an error (the compiled path is what these tests are about)."""
    with torch._dynamo.config.patch(recompile_limit=512, accumulated_recompile_limit=8192,
                                    fail_on_recompile_limit_hit=True):
        yield
