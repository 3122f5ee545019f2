"""Where a node finds its identity key and roster: node config, then ``FEDPARITY_IDENTITY_DIR``,
then its own default folder ``~/.fedparity/identity``.

Before the default folder, a simulation's nodes found their identities only through
``FEDPARITY_IDENTITY_DIR`` in the environment of the SuperLink *when it started*: a user who
had run any ``flwr`` command first (which leaves a SuperLink running) got 354 lines of
refusals from the FedEvalFair guide's command. ``fedparity identity --nodes N`` now writes to
the default folder, where the nodes find their files by themselves.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from fedparity.clients import identity as node_identities
from fedparity.clients.identity import (
    IDENTITY_DIR_ENV,
    ROSTER_FILE,
    identity_key_file,
    node_identity,
)
from fedparity.mechanisms.crypto.identity import IdentityError, IdentityKey
from fedparity.server.cli import main
from fedparity.server.cli.identity import write_node_identities


def test_a_simulated_node_finds_its_key_in_the_default_folder(tmp_path: Path) -> None:
    folder = write_node_identities(tmp_path / "default", 3)
    found = node_identity({"partition-id": 2}, {}, default_dir=folder)
    key, roster = found.require("FedEvalFair")
    assert (
        key.public_bytes()
        == node_identity(
            {"identity-key": str(folder / identity_key_file(2))}, {}
        ).key.public_bytes()
    )  # type: ignore[union-attr]
    assert len(roster) == 3
    # without a partition id (a deployed node) the folder gives the roster, never a key
    assert node_identity({}, {}, default_dir=folder).key is None


def test_the_environment_and_the_node_config_come_before_the_default_folder(
    tmp_path: Path,
) -> None:
    default = write_node_identities(tmp_path / "default", 2)
    other = write_node_identities(tmp_path / "other", 2)
    default_key = node_identity({"partition-id": 0}, {}, default_dir=default).key
    from_env = node_identity(
        {"partition-id": 0}, {IDENTITY_DIR_ENV: str(other)}, default_dir=default
    ).key
    configured = node_identity(
        {
            "partition-id": 0,
            "identity-key": str(other / identity_key_file(1)),
            "roster": str(other / ROSTER_FILE),
        },
        {},
        default_dir=default,
    ).key
    assert default_key is not None and from_env is not None and configured is not None
    keys = {k.public_bytes() for k in (default_key, from_env, configured)}
    assert len(keys) == 3


def test_a_default_folder_without_a_roster_gives_no_identity(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / identity_key_file(0)).write_text("not a key")
    found = node_identity({"partition-id": 0}, {}, default_dir=tmp_path / "empty")
    assert found.key is None and found.roster is None
    with pytest.raises(IdentityError):
        found.require("FedEvalFair")


def test_fedparity_identity_writes_to_the_default_folder_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    default = tmp_path / "home" / ".fedparity" / "identity"
    assert node_identities.default_identity_dir() == default
    out = io.StringIO()
    assert main(["identity", "--nodes", "2"], out=out) == 0
    assert sorted(p.name for p in default.iterdir()) == [
        identity_key_file(0),
        identity_key_file(1),
        ROSTER_FILE,
    ]
    assert "the nodes of a simulation on this machine find them here" in out.getvalue()
    assert node_identity({"partition-id": 1}, {}, default_dir=default).key is not None
    # with --out elsewhere, the nodes need to be told (node config or the variable)
    out = io.StringIO()
    assert main(["identity", "--nodes", "2", "--out", str(tmp_path / "x")], out=out) == 0
    assert f"{IDENTITY_DIR_ENV}={tmp_path / 'x'}" in out.getvalue()


def test_fedparity_identity_run_again_keeps_the_keys_and_refuses_a_changed_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The FedEvalFair and pipeline guides both start with ``fedparity identity --nodes 4``:
    run again, the keys are kept (exit 0; before: exit 2 in the middle of the second guide).
    A key that no longer matches the roster, or more nodes, still needs ``--overwrite``."""
    folder = tmp_path / "identity"
    argv = ["identity", "--nodes", "2", "--out", str(folder)]
    assert main(argv, out=io.StringIO()) == 0
    keys = {path.name: path.read_bytes() for path in folder.iterdir()}
    out = io.StringIO()
    assert main(argv, out=out) == 0
    assert "already in" in out.getvalue() and "kept" in out.getvalue()
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == keys
    assert main(["identity", "--nodes", "3", "--out", str(folder)], out=io.StringIO()) == 2
    IdentityKey.generate().write(folder / identity_key_file(1), overwrite=True)  # not listed
    assert main(argv, out=io.StringIO()) == 2
    assert "--overwrite" in capsys.readouterr().err
