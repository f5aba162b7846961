"""Outputs are written whole or not at all, with the permissions a plain create gives."""

import os
import stat

import pytest

from quantlab.utils.atomic import OutputExistsError, atomic_directory, atomic_file


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_directory_and_file_get_ordinary_permissions(tmp_path, umask_022):
    with atomic_directory(tmp_path / "out") as staging:
        (staging / "weights").write_text("w")
    with atomic_file(tmp_path / "report.json") as staging:
        staging.write_text("{}")
    assert _mode(tmp_path / "out") == 0o755
    assert _mode(tmp_path / "report.json") == 0o644


def test_a_failure_leaves_the_previous_output_and_no_staging(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "out", overwrite=True) as staging:
        (staging / "new").write_text("half")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["old"]


def test_overwrite_replaces_and_refusal_names_the_fix(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputExistsError, match="--overwrite"), atomic_directory(tmp_path / "out"):
        pass
    with atomic_directory(tmp_path / "out", overwrite=True) as staging:
        (staging / "new").write_text("new")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
