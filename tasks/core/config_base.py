"""What every config section is built from: `Section` (unknown keys are errors, assignments are validated, no
inf or nan), the markers that say how a field enters the fingerprints (HOW_NOT_WHAT, SINCE_DEFAULT), and the
config's warnings (`warn`, `moved`: a line once per process, held back while load_config reads a config).

The section modules (config_inputs, config_generate, config_reward, config_train, config_publish, config_infra)
build on it; tasks/core/config.py assembles them into the whole config.
More: docs/internals.md (tasks/core/config_base.py): the fingerprint markers and the held-back warnings.
"""

from __future__ import annotations

import sys
import threading

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, populate_by_name=True)


# A field that changes how a result is computed, not the result (tested bit-identical): left out of the
# fingerprints, so a run may switch it between two flow runs without "made from a different config".
HOW_NOT_WHAT = {"fingerprint": False}
# A field added after runs already existed: left out of the fingerprints while it has its default (which is
# what those runs did), so they resume across the upgrade; a run that sets it is fingerprinted with it.
SINCE_DEFAULT = {"fingerprint": "when-set"}


def moved(old: str, new: str, what: str = "key") -> None:
    """One warning line on stderr per old key (or value: `what`) and process: it is read, its new name is `new`."""
    warn(f"warning: config: {old} is now {new} (read as that; write the new {what})")


_SAID: set[str] = set()
_HELD = threading.local()        # .lines: warnings of a load_config under way, said only if the config is accepted


def warn(line: str) -> None:
    """A warning about the config, once per process: on stderr now, or, while load_config reads one, once it
    accepts it (a refused config's refusal is its only line)."""
    held = getattr(_HELD, "lines", None)
    if held is not None:
        held.append(line)
    elif line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr)
