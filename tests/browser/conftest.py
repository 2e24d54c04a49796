"""The browser tests' shared JupyterLab server fixture (``tests/browser/_lab.py``)."""

from tests.browser._lab import lab_server  # noqa: F401  (the fixture, by name)
