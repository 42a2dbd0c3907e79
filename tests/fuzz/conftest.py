"""The fuzz suite's imports: real processes (tests/reliability/sp_harness.py) and the strategies here.

Settings live in fuzz_strategies.fuzz_settings (test modules never import from a
conftest by name: pytest keeps only one module called `conftest`).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Hypothesis imports its patch writer (libcst, where installed) only when a test fails, and libcst's
# import raises a DeprecationWarning the suite turns into an error: a failure would then be reported
# as an INTERNALERROR. Import it once here, warnings silenced, so a failure reads as a failure.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        import hypothesis.extra._patching  # noqa: F401 - imported for its side effect, see above
    except Exception:  # noqa: BLE001 - libcst absent: nothing to pre-import
        pass

