"""Packaging: the wheel installs ``sparse_ref`` with its subpackages (``sparse_ref.kernels`` among them, and the
top-k's ``sparse_ref.kernels.topk``) and nothing as a top-level ``kernels`` (the repository's ``kernels/`` folder
holds the lesson kernels: no ``__init__.py``, never in the wheel).

``kernels`` is also a popular PyPI package, so shadowing it would break users. The wheel is built
from a copy of the sources in a temporary folder (nothing is written into the checkout), unpacked,
and imported from a subprocess started outside the repository.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["pyproject.toml", "README.md", "sparse_ref"]

pytestmark = pytest.mark.skipif(not (REPO / "pyproject.toml").exists(), reason="needs the source tree")


def run(args, cwd, env=None):
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory):
    """Build the wheel once; return (names inside it, folder it was unpacked into)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.exists():
            src.mkdir(exist_ok=True)
            shutil.copy(path, src / name)
    # Without build isolation (fast, offline) when this environment can build; otherwise pip fetches
    # the build backend (Python 3.12+ venvs no longer ship setuptools).
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    out = run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", *isolation, "-q",
               "-w", str(tmp / "dist")], cwd=tmp)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp / "dist").glob("sparse_ref-*.whl")
    site = tmp / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(site)
    return names, site


def test_wheel_has_kernels_inside_the_package(wheel_files):
    names, _ = wheel_files
    assert "sparse_ref/kernels/__init__.py" in names
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"sparse_ref"}, f"only sparse_ref may be installed at top level, got {sorted(top_level)}"
    assert not any(n.startswith("kernels/") for n in names)


def test_wheel_holds_every_source_file(wheel_files):
    """A subpackage missing from pyproject's package list would be silently left out of the install."""
    names, _ = wheel_files
    def sources(folder: str, pattern: str, prefix: str) -> set[str]:
        root = REPO / folder
        found = [p for p in root.rglob(pattern) if "__pycache__" not in p.parts]
        return {f"{prefix}/{p.relative_to(root).as_posix()}" for p in found}

    want = sources("sparse_ref", "*.py", "sparse_ref")
    assert {"sparse_ref/kernels/topk/__init__.py", "sparse_ref/bench/__main__.py"} <= want
    want |= sources("sparse_ref", "*.json", "sparse_ref")
    missing = sorted(want - set(names))
    assert not missing, f"not in the wheel: {missing}. Fix: list the subpackage / data in pyproject.toml"


def test_installed_layout_imports_outside_the_repo(wheel_files, tmp_path):
    _, site = wheel_files
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(site)
    probe = "import sparse_ref.kernels, sparse_ref; print(sparse_ref.__file__); print(sparse_ref.kernels.__file__)"
    out = run([sys.executable, "-c", probe], cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    pkg, kern = out.stdout.split()
    assert Path(pkg).is_relative_to(site) and Path(kern) == site / "sparse_ref" / "kernels" / "__init__.py"
    assert_no_kernels_package(tmp_path, env)


PROBE = "import kernels; print(getattr(kernels, '__file__', None)); print(list(kernels.__path__))"


def assert_no_kernels_package(cwd, env):
    """``import kernels`` finds no package of ours: it fails, or (an editable install puts the checkout's root on
    the path) it finds the lesson folder ``kernels/`` as a bare namespace (no ``__init__.py``, no code run), which
    any installed package named ``kernels`` outranks (``test_a_real_kernels_package_wins``)."""
    out = run([sys.executable, "-c", PROBE], cwd=cwd, env=env)
    if out.returncode != 0:
        assert "No module named 'kernels'" in out.stderr
        return
    file, path = out.stdout.splitlines()
    assert file == "None" and path == repr([str(REPO / "kernels")]), out.stdout


def test_a_real_kernels_package_wins(tmp_path):
    """Someone's installed ``kernels`` (a regular package) outranks the lesson folder, wherever it sits on the path."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("NAME = 'installed'\n")
    for where in (str(site), os.pathsep.join([str(REPO), str(site)])):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = where
        out = run([sys.executable, "-c", "import kernels; print(kernels.NAME)"], cwd=tmp_path, env=env)
        assert out.returncode == 0 and out.stdout.strip() == "installed", out.stderr


def test_current_install_does_not_expose_top_level_kernels(tmp_path):
    """Whatever install runs these tests (editable or not), ``import kernels`` fails outside the repo."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert_no_kernels_package(tmp_path, env)
    out = run([sys.executable, "-c", "import sparse_ref.kernels"], cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
