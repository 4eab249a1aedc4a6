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


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """Where tiny test models are built (once per session; SPECRAY_TINY_DIR reuses a folder across runs)."""
    root = os.environ.get("SPECRAY_TINY_DIR")
    if root:
        os.makedirs(root, exist_ok=True)
        return root
    return str(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny(tiny_root):
    """A tiny Llama target with a high-agreement ("mid") and a low-agreement ("small") draft, fp32."""
    from specray.testing.tiny import tiny_family

    return tiny_family(tiny_root)


@pytest.fixture(scope="session")
def rep_target(tiny_root):
    """A tiny fp32 target vLLM can run whose greedy text repeats itself (n-gram drafts really accept);
    skips the test without vllm."""
    pytest.importorskip("vllm")
    from specray.testing.tiny import repetitive_target

    return repetitive_target(tiny_root)
