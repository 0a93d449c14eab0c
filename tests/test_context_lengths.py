"""Lengths a run cannot afford, refused (or warned of) before it starts: a reasoning-gym split too large to make
in memory, and prompt + completion lengths past the model's context (vLLM's derived max_model_len)."""

import pytest

from tasks.core.config import load_config
from tasks.core.errors import UserError
from tests.conftest import TINY


@pytest.mark.parametrize("field", ["size", "eval_size"])
def test_a_reasoning_gym_split_a_run_cannot_make_is_refused_as_the_config_is_read(field):
    """A million held-out items took `rlflow plan` 4 minutes and 5 GB: the bound is 100,000 items."""
    sizes = {"size": 10, "eval_size": 10, field: 1000000}
    spec = "{task: leg_counting, " + ", ".join(f"{k}: {v}" for k, v in sizes.items()) + "}"
    with pytest.raises(UserError, match=rf"data\.reasoning_gym\.{field}: input should be less than or equal to "
                                        r"100000, got 1000000"):
        load_config(TINY, ["data.path=null", f"data.reasoning_gym={spec}"])
    load_config(TINY, ["data.path=null", "data.reasoning_gym={task: leg_counting, size: 100000, eval_size: 100000}"])
