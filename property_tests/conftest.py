"""Hypothesis profiles for the property suite, chosen by ``FREPLICATE_HYPOTHESIS_PROFILE``.

- ``ci`` (the default): derandomized, so every run draws the same examples;
  about 50 examples a property (fewer where one example is costly: see
  ``_property_support.examples``); no example database; no deadline, as
  timings on shared CI machines are noise.
- ``dev``: a quick random pass while editing (10 examples).
- ``thorough``: 1,000 random examples a property, for a long run before a
  release: ``FREPLICATE_HYPOTHESIS_PROFILE=thorough pytest property_tests``.

This directory is put on ``sys.path`` so that the tests import their helpers
by name, and the spawned distributed ranks can import the rank-side code; so
is the repository's root, so that the ranks can import a test module itself
by the name pytest gives it (``property_tests.test_docs_ddp_example``, under
``--import-mode=importlib``), whichever way pytest was started.
"""

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", max_examples=50, derandomize=True, database=None, **_COMMON)
settings.register_profile("dev", max_examples=10, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)

_PROFILE = os.environ.get("FREPLICATE_HYPOTHESIS_PROFILE", "ci")
if _PROFILE not in ("ci", "dev", "thorough"):
    raise ValueError(
        f"FREPLICATE_HYPOTHESIS_PROFILE={_PROFILE!r}: choose 'ci', 'dev' or 'thorough'"
    )
settings.load_profile(_PROFILE)
