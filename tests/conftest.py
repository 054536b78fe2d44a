import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def isolated_model_cache(tmp_path_factory):
    """The default model is materialised into a per-run directory, never into the user's cache; or into
    SIDECAR_TEST_CACHE_DIR, which bin/test sets so that its three suites build it once."""
    os.environ["SIDECAR_CACHE_DIR"] = os.environ.get("SIDECAR_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("sidecar-cache"))
