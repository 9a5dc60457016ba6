"""Packaging: what pip is told agrees with what the plugin checks and uses.

- pyproject.toml requires the series of `vllm_kvevict.VLLM_VERSION` (the one
  release register() accepts and scripts/setup.sh installs), and the installed
  `vllm` distribution (on CPU, the shim at VLLM_VERSION+cpu) satisfies it, so
  `pip install -e .` never fetches another vLLM;
- ray, transformers and gguf are extras, and no shipped module imports them at
  module level: only the paths that need them (the Ray executor, calibration,
  model conversion, the harness) do, when they run;
- scripts/setup.sh installs extras that pyproject.toml declares.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

import vllm_kvevict

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPTIONAL = ("ray", "transformers", "gguf")


def _vllm_requirement() -> Requirement:
    (req,) = [Requirement(r) for r in PROJECT["dependencies"] if Requirement(r).name == "vllm"]
    return req


def test_vllm_requirement_is_the_pinned_series():
    req, pin = _vllm_requirement(), Version(vllm_kvevict.VLLM_VERSION)
    assert str(req.specifier) == f"=={pin.major}.{pin.minor}.*"
    # the CPU shim's version (patches/vllm_dist_shim, set by scripts/setup.sh)
    assert req.specifier.contains(f"{pin}+cpu") and req.specifier.contains(pin)


def test_installed_vllm_satisfies_it():
    installed = importlib.metadata.version("vllm")
    assert _vllm_requirement().specifier.contains(installed), installed


def test_optional_packages_are_extras():
    extras = PROJECT["optional-dependencies"]
    declared = {Requirement(r).name for reqs in extras.values() for r in reqs}
    required = {Requirement(r).name for r in PROJECT["dependencies"]}
    assert set(OPTIONAL) <= declared and not set(OPTIONAL) & required


def test_optional_packages_are_imported_where_used():
    eager = []
    for folder in ("vllm_kvevict", "patches", "triton_kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:  # module level only
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                eager += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.split(".")[0] in OPTIONAL]
    assert not eager, eager


def test_setup_installs_declared_extras():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    (extras,) = re.findall(r"^EXTRAS=(\S+)$", setup, re.M)
    assert set(extras.split(",")) <= set(PROJECT["optional-dependencies"]), extras
    assert f'".[$EXTRAS]"' in setup
