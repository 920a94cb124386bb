"""scripts/setup_pillow in a throwaway venv, with pip for real: plain Pillow installed over pillow-simd
(as ``pip install torchvision`` does) is repaired, and a pillow-simd that cannot be installed leaves a
working plain Pillow. The two distributions are tiny local wheels that own the same ``PIL/`` files, as
the real ones do (building the real pillow-simd takes minutes); pip runs offline on them."""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pip as pip_module
import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def fake_wheel(folder: Path, name: str, version: str) -> None:
    """A wheel of distribution ``name`` whose only file is ``PIL/__init__.py`` saying ``version``."""
    files = {"PIL/__init__.py": f"__version__ = {version!r}\n".encode()}
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for path, data in files.items()]
    files[f"{info}/RECORD"] = ("\n".join(record + [f"{info}/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("setup")
    wheels = root / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "pillow", "12.1.1")
    fake_wheel(wheels, "pillow-simd", "12.1.1.post0")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=TIMEOUT_S)
    lent = root / "lent"  # this interpreter's pip, lent to the venv (ensurepip would take seconds)
    lent.mkdir()
    (lent / "pip").symlink_to(Path(pip_module.__file__).parent)
    site = next((root / "venv/lib").glob("python*/site-packages"))
    (site / "lent-pip.pth").write_text(f"{lent}\n")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PY": str(root / "venv/bin/python"),
           "VENV": str(root / "venv"), "LOG": str(root / "setup.log"), "PILLOW_SIMD_PIN": "pillow-simd==12.1.1.post0"}
    return root / "venv", env


def pip(env: dict[str, str], *args: str) -> None:
    subprocess.run([env["PY"], "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True, env=env,
                   capture_output=True, timeout=TIMEOUT_S)


def setup_pillow(env: dict[str, str]) -> str:
    run = subprocess.run([str(ROOT / "scripts/setup_pillow")], env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


_STATE = """
import importlib.metadata as m
try:
    import PIL
    version = PIL.__version__
except ImportError:
    version = "missing"
print(version, *sorted(f"{d.metadata['Name']}=={d.version}" for d in m.distributions()
                       if d.metadata["Name"].lower().startswith("pillow")))
"""


def state(env: dict[str, str]) -> list[str]:
    """What ``import PIL`` finds, then the Pillow distributions pip lists."""
    return subprocess.run([env["PY"], "-c", _STATE], capture_output=True, text=True, env=env,
                          timeout=TIMEOUT_S).stdout.split()


def test_plain_pillow_over_pillow_simd_is_repaired_and_a_failed_build_leaves_plain_pillow(
    venv: tuple[Path, dict[str, str]]
) -> None:
    path, env = venv
    assert "building pillow-simd==12.1.1.post0 in place of pillow" in setup_pillow(env)
    assert state(env) == ["12.1.1.post0", "pillow-simd==12.1.1.post0"]
    assert setup_pillow(env) == ""  # in place: nothing to do

    pip(env, "install", "pillow==12.1.1")  # what pip install torchvision does
    assert state(env) == ["12.1.1", "pillow-simd==12.1.1.post0", "pillow==12.1.1"]
    out = setup_pillow(env)
    assert out.startswith("setup: pillow-simd's PIL was replaced (plain; e.g. by pip install torchvision)")
    assert state(env) == ["12.1.1.post0", "pillow-simd==12.1.1.post0"]

    pip(env, "install", "pillow==12.1.1")
    out = setup_pillow({**env, "PILLOW_SIMD_PIN": "pillow-simd==99.0"})  # cannot be installed here
    assert "NOTE pillow-simd could not be built here" in out and "installing plain pillow" in out
    assert state(env) == ["12.1.1", "pillow==12.1.1"]
    assert (path / ".pillow-simd-failed").exists()
    assert setup_pillow(env) == ""  # noted once: plain Pillow stays
