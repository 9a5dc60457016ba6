"""Run from the repository root, `import triton_kernels` would find the plugin's
own kernels folder, which vLLM then took for OpenAI's `triton_kernels` package
(MoE kernels) and logged "Failed to import Triton kernels" at every start.
`register()` frees the name (`triton_kernels.free_top_level_name`): the real
package when one is installed, else absent, as without the clone on sys.path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> list[str]:
    """Lines printed by `python -c code` started in the repository root, whose
    sys.path[0] is then the root (as for `python -m vllm_kvevict.demo`)."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _installed(tmp_path: Path, body: str) -> str:
    """A stand-in for an installed `triton_kernels` whose __init__ is `body`;
    returns the code line that puts it on sys.path (after the root, as
    site-packages is)."""
    (tmp_path / "triton_kernels").mkdir()
    (tmp_path / "triton_kernels" / "__init__.py").write_text(body)
    return f"import sys; sys.path.append({str(tmp_path)!r})\n"


def test_no_package_installed_reads_as_absent():
    assert _python(
        "import importlib.util, os\n"
        "print(os.path.relpath(importlib.util.find_spec('triton_kernels').origin))\n"
        "from vllm_kvevict.triton_kernels import free_top_level_name\n"
        "free_top_level_name()\n"
        "print(importlib.util.find_spec('triton_kernels'))\n"
        "try:\n"
        "    import triton_kernels\n"
        "except ModuleNotFoundError:\n"
        "    print('absent')\n") == [
        "triton_kernels/__init__.py",  # the shadow this guards against
        "None", "absent"]


def test_installed_package_is_the_one_imported(tmp_path):
    assert _python(
        _installed(tmp_path, "WHO = 'installed'\n")
        + "from vllm_kvevict.triton_kernels import free_top_level_name\n"
        "free_top_level_name()\n"
        "import triton_kernels, vllm_kvevict.triton_kernels as ours\n"
        "print(triton_kernels.WHO, ours.__name__)\n") == [
        "installed", "vllm_kvevict.triton_kernels"]


def test_broken_installed_package_reads_as_absent(tmp_path):
    """A package that fails to import must not stop the plugin from loading."""
    assert _python(
        _installed(tmp_path, "raise RuntimeError('broken install')\n")
        + "import importlib.util\n"
        "from vllm_kvevict.triton_kernels import free_top_level_name\n"
        "free_top_level_name()\n"
        "print(importlib.util.find_spec('triton_kernels'))\n") == ["None"]
