"""What a release ships: the sdist and the wheel build, carry the licence and the changelog, and
the wheel installed alone in a fresh venv runs the README's first command and migrates a table
from its own copy of the migrations. (CI's ``twine check`` reads the same two files.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest
import sqlalchemy as sa

from sqllocker.migrations import current_revision, head_revision, schema_differences

REPO = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX venv layout"),
]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel, built as a release builds them (the wheel from the sdist)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return out


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding ``.venv``: a fresh venv with the wheel alone installed in it."""
    home = tmp_path_factory.mktemp("home")
    (wheel,) = dist.glob("sqllocker-*.whl")
    venv.create(home / ".venv", with_pip=True)
    subprocess.run(
        [str(home / ".venv" / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return home


def test_the_sdist_and_the_wheel_carry_the_licence_and_the_changelog(dist: Path) -> None:
    licence = (REPO / "LICENSE").read_text()
    assert licence.startswith("MIT License")
    (sdist,) = dist.glob("sqllocker-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {
            Path(name).relative_to(Path(name).parts[0]).as_posix() for name in archive.getnames()
        }
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml"} <= names
    (wheel,) = dist.glob("sqllocker-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        info = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        metadata = archive.read(info).decode()
        shipped = archive.read(info.replace("METADATA", "licenses/LICENSE")).decode()
    assert "License-Expression: MIT" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
    assert shipped == licence


def test_the_wheel_alone_runs_the_readmes_first_command(installed: Path) -> None:
    """The README's first command, as a user pastes it, with the venv already made from the
    wheel (``pip install .`` would install the checkout): on the SQLite default, in a directory
    of its own, it runs its command under the lock."""
    first = re.search(r"```sh\n(.*?)\n```", (REPO / "README.md").read_text(), re.S)
    assert first is not None
    venv_made, installing, command = first.group(1).split(" && ")
    assert venv_made == "python3 -m venv .venv"
    assert installing == ".venv/bin/pip install ."
    assert command.startswith(".venv/bin/sqllocker run ")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQLLOCKER_", "PYTHON"))}
    ran = subprocess.run(
        ["/bin/sh", "-c", command],
        cwd=installed,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert "the nightly report ran under the lock" in ran.stdout
    assert (installed / "sqllocker.db").exists()  # the default: a file where it ran


def test_the_wheel_alone_migrates_from_its_own_scripts(installed: Path, tmp_path: Path) -> None:
    database = tmp_path / "wheel.db"
    elsewhere = tmp_path / "elsewhere"  # not the checkout: the scripts must come from the wheel
    elsewhere.mkdir()
    migrate = subprocess.run(
        [
            str(installed / ".venv" / "bin" / "sqllocker"),
            "--url",
            f"sqlite:///{database}",
            "migrate",
        ],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert migrate.returncode == 0, migrate.stderr
    engine = sa.create_engine(f"sqlite:///{database}")
    assert current_revision(engine) == head_revision()
    assert schema_differences(engine) == []
    engine.dispose()
    where = subprocess.run(
        [str(installed / ".venv" / "bin" / "python"), "-c",
         "import sqllocker.migrations as m; print(m.script_location())"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        check=True,
    )  # fmt: skip
    assert "site-packages" in where.stdout
    assert (Path(where.stdout.strip()) / "versions").is_dir()
