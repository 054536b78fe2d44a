import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def isolated_model_cache(tmp_path_factory):
    """The default model is materialised into a per-run directory, never into the user's cache."""
    os.environ["SIDECAR_CACHE_DIR"] = str(tmp_path_factory.mktemp("sidecar-cache"))
