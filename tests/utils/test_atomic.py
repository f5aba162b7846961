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


def test_an_output_that_appears_meanwhile_is_not_replaced(tmp_path):
    """The existence check is repeated at the final rename: a second writer's folder survives."""
    appeared = pytest.raises(OutputExistsError, match="appeared while this command ran")
    with appeared, atomic_directory(tmp_path / "out") as staging:
        (staging / "mine").write_text("mine")
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "theirs").write_text("theirs")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["theirs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_concurrent_writers_one_wins_whole_the_other_is_refused(tmp_path):
    """Both pass the first check; the second rename finds the first writer's output and keeps it."""
    import threading

    both_staged = threading.Barrier(2)
    outcomes: dict[str, str] = {}

    def write(name: str) -> None:
        try:
            with atomic_directory(tmp_path / "out") as staging:
                (staging / "writer").write_text(name)
                both_staged.wait(timeout=30)
            outcomes[name] = "written"
        except OutputExistsError:
            outcomes[name] = "refused"

    threads = [threading.Thread(target=write, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes.values()) == ["refused", "written"]
    winner = next(name for name, outcome in outcomes.items() if outcome == "written")
    assert (tmp_path / "out" / "writer").read_text() == winner
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_output_appearing_just_before_the_rename_is_kept_without_overwrite(tmp_path, monkeypatch):
    """The race the concurrent test hits now and then, made certain: another writer's output appears after
    the last check and before the rename; without overwrite it is kept and this writer is refused."""
    from quantlab.utils import atomic

    checks = []
    real_check = atomic.check_replaceable

    def check_then_other_writer_finishes(target, overwrite, protect):
        real_check(target, overwrite, protect)
        checks.append(target)
        if len(checks) == 2:  # the check after the block ran: the other writer renames its output now
            (target / "writer").parent.mkdir()
            (target / "writer").write_text("other")

    monkeypatch.setattr(atomic, "check_replaceable", check_then_other_writer_finishes)
    with pytest.raises(OutputExistsError, match="appeared"), atomic_directory(tmp_path / "out") as staging:
        (staging / "writer").write_text("this")
    assert (tmp_path / "out" / "writer").read_text() == "other"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_never_deletes_a_protected_input_or_the_current_directory(tmp_path, monkeypatch):
    from quantlab.utils.atomic import UnsafeOutputError

    (tmp_path / "x" / "model").mkdir(parents=True)
    (tmp_path / "x" / "model" / "weights").write_text("w")
    refused = pytest.raises(UnsafeOutputError, match="contains the input")
    with refused, atomic_directory(tmp_path / "x", overwrite=True, protect=[tmp_path / "x" / "model"]):
        pass
    monkeypatch.chdir(tmp_path / "x")
    with pytest.raises(UnsafeOutputError, match="current directory"), atomic_directory(tmp_path / "x", overwrite=True):
        pass
    with pytest.raises(UnsafeOutputError, match="current directory"), atomic_directory(".", overwrite=True):
        pass
    assert (tmp_path / "x" / "model" / "weights").read_text() == "w"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def _dead_pid() -> int:
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_leftovers_of_a_dead_writer_are_removed_and_a_half_swapped_output_restored(tmp_path):
    from quantlab.utils.atomic import _host_tag

    host, dead, alive = _host_tag(), _dead_pid(), os.getppid()
    dead_staging = tmp_path / f".out.tmp-{dead}-{host}-abc"
    live_staging = tmp_path / f".out.tmp-{alive}-{host}-abc"  # a concurrent writer: left alone
    retired = tmp_path / f".out.old-{dead}-{host}-abc"
    for folder in (dead_staging, live_staging, retired / "out"):
        folder.mkdir(parents=True)
    (retired / "out" / "weights").write_text("previous")  # killed between its two renames

    with atomic_directory(tmp_path / "other") as staging:  # another output's leftovers are not its business
        (staging / "x").write_text("x")
    assert dead_staging.exists() and retired.exists()

    with pytest.raises(OutputExistsError), atomic_directory(tmp_path / "out"):  # restored, so not replaced
        pass
    assert (tmp_path / "out" / "weights").read_text() == "previous"
    assert not dead_staging.exists() and not retired.exists() and live_staging.exists()
