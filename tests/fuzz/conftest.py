"""Fixtures of the fuzz suite: real processes (tests/reliability/sp_harness.py) and hypothesis settings.

`FUZZ` is applied per test (never as a global profile: other suites' hypothesis
tests keep their own settings). CI runs a derandomised, bounded number of
examples so a run is reproducible; `SANDPOOL_LONG=1` runs many more, randomised.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LONG = os.environ.get("SANDPOOL_LONG") == "1"

# Hypothesis imports its patch writer (libcst, where installed) only when a test fails, and libcst's
# import raises a DeprecationWarning the suite turns into an error: a failure would then be reported
# as an INTERNALERROR. Import it once here, warnings silenced, so a failure reads as a failure.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        import hypothesis.extra._patching  # noqa: F401
    except Exception:  # noqa: BLE001 - libcst absent: nothing to pre-import
        pass


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples * 20 if LONG else examples,
        derandomize=not LONG,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                               HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=True,
        # no explain phase: its report imports a module whose DeprecationWarning the suite turns into an error
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    )
