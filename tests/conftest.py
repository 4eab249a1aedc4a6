import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("SPECRAY_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: use --runslow or SPECRAY_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
