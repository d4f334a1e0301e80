"""The structured-output backends a test runs on: guidance (llguidance, a dependency) always, xgrammar (the test
extra) where it is installed; without it, its cases are skipped rather than failed."""
import importlib.util

import pytest

XGRAMMAR_MISSING = importlib.util.find_spec("xgrammar") is None
needs_xgrammar = pytest.mark.skipif(XGRAMMAR_MISSING, reason="xgrammar is not installed: pip install -e '.[test]'")
GRAMMAR_BACKENDS = ["guidance", pytest.param("xgrammar", marks=needs_xgrammar)]
