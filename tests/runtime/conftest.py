"""Every runtime test compiles into a per-session cache, never the user's ~/.cache/qir."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _session_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("QIR_CACHE_DIR", str(tmp_path_factory.mktemp("qir-cache")))
    yield
    mp.undo()
