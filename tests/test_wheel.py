"""The wheel a user installs: ``make wheel`` builds the sdist and, from it, a manylinux
wheel with ``sarp._native`` inside; installed into a fresh venv with no compiler on
PATH (and no package built from source), ``sarp --version``, ``import sarp`` on the C
path and a short ``sarp bench`` all work."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_the_wheel_installs_and_runs_without_a_compiler(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    built = subprocess.run(["make", "wheel"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, env=env)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels = list((ROOT / "dist").glob("sarp-*-cp311-cp311-manylinux*_x86_64.whl"))
    assert len(wheels) == 1, list((ROOT / "dist").iterdir())
    with zipfile.ZipFile(wheels[0]) as z:
        names = z.namelist()
    assert any(n.startswith("sarp/_native.") and n.endswith(".so") for n in names)
    assert "sarp-0.1.0.dist-info/licenses/LICENSE" in names
    with tarfile.open(next((ROOT / "dist").glob("sarp-*.tar.gz"))) as t:
        shipped = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for needed in ("LICENSE", "CHANGELOG.md", "tests/conftest.py", "tests/servekit.py",
                   "tests/vectors/golden.json", "src/sarp/vendor/xxhash.h",
                   "src/sarp/native.h", "docs/operating.md", "deploy/Dockerfile"):
        assert needed in shipped, needed

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    nothing = tmp_path / "no-compiler"  # PATH: the venv and an empty folder, no cc
    nothing.mkdir()
    clean = {"PATH": f"{venv / 'bin'}:{nothing}", "HOME": str(tmp_path), "CC": "false",
             "LANG": "C.UTF-8", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for key in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONFIG_FILE"):
        if key in os.environ:
            clean[key] = os.environ[key]
    installed = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "--quiet",
                                "--only-binary", ":all:", str(wheels[0])],
                               capture_output=True, text=True, timeout=900, env=clean)
    assert installed.returncode == 0, installed.stderr[-3000:]

    def run(*cmd: str) -> str:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean,
                             cwd=tmp_path)
        assert out.returncode == 0, (cmd, out.stderr[-3000:])
        return out.stdout

    assert run("sarp", "--version").strip() == "sarp 0.1.0 (hot loops in C)"
    assert run(str(venv / "bin/python"), "-c", "import sarp, sarp.native; "
               "print(sarp.native.C is not None, sarp.__file__)").split()[0] == "True"
    assert str(venv) in run(str(venv / "bin/python"), "-c", "import sarp; print(sarp.__file__)")
    table = run("sarp", "bench", "--indexes", "sarp,memory-dict", "--limit-requests", "300",
                "--passes", "1", "--pass-s", "0.1")
    assert "sarp" in table and "memory-dict" in table
    # without the bench extra, what needs it says so in one line before any work
    missing = subprocess.run(["sarp", "bench", "--indexes", "rocksdb-per-block"],
                             capture_output=True, text=True, timeout=120, env=clean)
    assert missing.returncode == 2
    assert missing.stderr.strip().endswith("pip install 'sarp[bench]' (or pass --indexes "
                                           "without rocksdb-per-block)")
