"""The app gate: a SuperNode runs only the app bundles (FABs) its operator approved.

In Flower the server ships the ClientApp code. A run's app bundle names its own
``clientapp`` component, and the SuperNode installs the bundle and imports that component
beside the node's data, keys and secret context: a server that ships its own client code
voids every node-side protection. Flower's ``flower-supernode --trusted-entities`` checks
signatures that only Flower Hub's bundles carry (the SuperLink adds them when it downloads an
app from the Hub); a bundle sent with ``flwr run .`` has none and is refused whatever its
content. The gate is the operator's own allow-list instead: the ``allowed-apps`` key of the
node's privacy policy (SHA-256 hashes of approved bundles), enforced in the process that runs
the ClientApps, before a byte of the bundle is installed or imported.

Three console scripts (``docs/deployment-security.md`` has the operator's commands):

* ``fedparity-superexec`` -- Flower's ``flower-superexec`` (same options, plus
  ``--privacy-policy FILE``) whose ClientApp processes are ``fedparity-clientapp``; the operator
  runs it next to ``flower-supernode --isolation process``. With ``--executor warm`` each of
  those processes is forked from a zygote that imported the ClientApp's modules once
  (:mod:`fedparity.clients.warm_clientapp`), and runs the same entry point and gate;
* ``fedparity-clientapp`` -- Flower's ``flwr-clientapp`` with the gate: it pulls the task
  (message, context, run, bundle) as Flower does, then refuses the bundle unless the SHA-256 of
  its bytes equals the hash the run names and is in the node policy's ``allowed-apps``, and
  unless the run names the app the bundle holds. Before every message it then checks that the
  folder Flower imports the ClientApp from (``$FLWR_HOME/apps/<publisher>.<name>.<version>.
  <hash>``, which Flower keeps once it exists) holds exactly the bundle's files, byte for byte
  (:func:`check_installed_app`). A refusal reaches the server as the fixed sentence
  :data:`APP_REFUSED_TEXT`, before any module of the bundle is imported;
* ``fedparity-app-hash`` -- the SHA-256 of a ``.fab`` file, or of the bundle ``flwr run``
  builds from an app folder: the value to put into ``allowed-apps``.

The node's policy comes from where all its other limits come from
(:func:`~fedparity.clients.policy.node_policy`: node config ``privacy-policy`` or policy keys,
else ``FEDPARITY_PRIVACY_POLICY`` of the SuperExec's environment); without ``allowed-apps`` every
bundle is refused, since the gate exists to restrict.

Flower internals used (checked against Flower 1.41, :data:`CHECKED_FLOWER`; both scripts refuse
to start under another version, and ``tests/test_app_gate.py`` fails if the structure changes):
the SuperExec's subprocess executor starts ``TASK_TYPE_TO_COMMAND[TaskType.CLIENT_APP]``
(``flwr.supercore.constant``), and ``flwr.supernode.runtime.run_clientapp.run_clientapp`` calls
the module's ``pull_task_input`` and then its ``install_from_fab`` inside the ``try`` whose
``except`` sends an error reply; :func:`install_gate` replaces those two names of that module.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import hmac
import io
import os
import shutil
import stat
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.common import log

from ..mechanisms.protocol.object_pulls import (
    IDLE_POLL_LONGEST,
    IdlePolls,
    PromptObjectPulls,
    time_with_sleep,
)
from .messages import NodeRefusal
from .policy import POLICY_ENV, NodePrivacyPolicy, PolicyRefusal, node_policy
from .warm_clientapp import WARM_EXECUTOR, check_fork_platform, install_warm_executor

__all__ = [
    "APP_REFUSED_TEXT",
    "CHECKED_FLOWER",
    "CLIENTAPP_COMMAND",
    "AppGate",
    "app_bundle_hash",
    "app_hash_main",
    "bundle_files",
    "check_app_bundle",
    "check_flower",
    "check_installed_app",
    "clientapp_main",
    "install_gate",
    "install_idle_task_polls",
    "superexec_main",
]

#: The Flower release series whose internals the gate was checked against.
CHECKED_FLOWER = "1.41"
#: What the server reads when the gate refuses a bundle (one fixed sentence for every reason).
APP_REFUSED_TEXT = "this node runs only app bundles its operator approved (allowed-apps); refusing"
#: The gated ClientApp command that ``fedparity-superexec`` starts instead of ``flwr-clientapp``.
CLIENTAPP_COMMAND = "fedparity-clientapp"


# ---------------------------------------------------------------------------- the check


def _sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def check_app_bundle(content: bytes, claimed_hash: str, policy: NodePrivacyPolicy) -> str:
    """The SHA-256 hex digest of the bundle ``content`` if the node may run it; otherwise
    :class:`~fedparity.clients.messages.NodeRefusal` with :data:`APP_REFUSED_TEXT` (the reason
    goes to the node's log only). Refused: a digest other than ``claimed_hash`` (the hash under
    which Flower installs and loads the bundle), a policy without ``allowed-apps``, a digest
    not in it."""
    digest = _sha256(content)
    if not (isinstance(claimed_hash, str) and hmac.compare_digest(digest, claimed_hash)):
        reason = "its bytes do not have the hash the run names"
    elif not policy.allowed_apps:
        reason = f"the node's policy ({policy.source}) has no allowed-apps: every bundle is refused"
    else:
        try:
            policy.check_app(digest)
            return digest
        except PolicyRefusal:
            reason = f"its hash is not in allowed-apps of the node's policy ({policy.source})"
    log(WARNING, "app gate: refused the app bundle with SHA-256 %s: %s", digest, reason)
    raise NodeRefusal(APP_REFUSED_TEXT)


# ------------------------------------------------------------------ the ClientApp process


def bundle_files(content: bytes) -> dict[str, bytes]:
    """The files Flower's installer writes into an app's folder from a bundle.

    Parameters
    ----------
    content : bytes
        The bundle's bytes (a zip archive).

    Returns
    -------
    dict[str, bytes]
        Each file's path in the app's folder (``/``-separated, as :mod:`zipfile` extracts
        it) and its bytes: every member of the bundle but those under ``.info/`` (which the
        installer removes) and folder entries.

    Raises
    ------
    ValueError
        If ``content`` is not a readable zip archive.
    """
    files: dict[str, bytes] = {}
    try:
        with zipfile.ZipFile(io.BytesIO(content)) as bundle:
            for member in bundle.infolist():
                parts = [p for p in member.filename.split("/") if p not in ("", ".", "..")]
                if member.is_dir() or not parts or parts[0] == ".info":
                    continue
                files["/".join(parts)] = bundle.read(member)
    except (zipfile.BadZipFile, NotImplementedError, RuntimeError, EOFError) as error:
        raise ValueError(f"the app bundle is not a readable zip archive ({error})") from None
    return files


def check_installed_app(folder: Path, files: Mapping[str, bytes], digest: str) -> None:
    """Refuse unless ``folder`` holds exactly the approved bundle's ``files``.

    Flower installs a bundle once, into ``$FLWR_HOME/apps/<publisher>.<name>.<version>.<first
    8 hex digits of its hash>``, and keeps that folder: when it exists, Flower's installer
    returns without looking into it, and the loader puts it first on ``sys.path`` and imports
    the ClientApp from it. Code written there by anyone who can write the folder would run
    under an approved bundle's name. Checked here: every file under ``folder`` is one of
    ``files`` with the same bytes, none of ``files`` is missing, and nothing is a symbolic
    link (folders without files are allowed: they hold no code). A bytecode cache
    (``__pycache__``) is a file not in the bundle, so it is refused too: Python would run a
    planted one instead of the unchanged source beside it, and the gate stops its own process
    from writing one (:meth:`AppGate.install_from_fab`).

    Parameters
    ----------
    folder : Path
        The folder Flower loads the ClientApp from.
    files : Mapping[str, bytes]
        The approved bundle's files (:func:`bundle_files`).
    digest : str
        The bundle's SHA-256, for the log.

    Raises
    ------
    NodeRefusal
        With :data:`APP_REFUSED_TEXT`; the node's log names the folder and what differs.
    """
    differences = _folder_differences(folder, files)
    if differences:
        more = len(differences) - 3
        shown = "; ".join(differences[:3]) + (f"; {more} more" if more > 0 else "")
        log(
            WARNING,
            "app gate: refused the app bundle with SHA-256 %s: the folder Flower loads it from, "
            "%s, does not hold exactly its files (%s). Someone changed that folder: find out "
            "who, then remove the folder (the gate installs the approved bundle again)",
            digest,
            folder,
            shown,
        )
        raise NodeRefusal(APP_REFUSED_TEXT)


def _folder_differences(folder: Path, files: Mapping[str, bytes]) -> list[str]:
    """What makes ``folder`` differ from ``files`` (empty: nothing)."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return ["it is not a folder"]
    except OSError as error:
        return [f"it cannot be read: {error.strerror}"]
    found: list[str] = []
    seen: set[str] = set()
    pending = [("", str(folder))]
    while pending:
        prefix, path = pending.pop()
        try:
            with os.scandir(path) as listing:
                entries = list(listing)
        except OSError as error:
            found.append(f"{prefix or './'} cannot be read: {error.strerror}")
            continue
        for entry in entries:
            name = prefix + entry.name
            if entry.is_symlink():
                found.append(f"{name} is a symbolic link")
            elif entry.is_dir(follow_symlinks=False):
                pending.append((name + "/", entry.path))
            elif name not in files:
                found.append(f"{name} is not in the bundle")
            else:
                seen.add(name)
                if not _holds(entry.path, files[name]):
                    found.append(f"{name} differs from the bundle's")
    found.extend(f"{name} is missing" for name in sorted(files.keys() - seen))
    return found


#: Opening a file to compare: never through a symbolic link, never blocking on a pipe.
_COMPARE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def _holds(path: str, content: bytes) -> bool:
    """Whether ``path`` is a regular file holding ``content``."""
    try:
        descriptor = os.open(path, _COMPARE_FLAGS | getattr(os, "O_BINARY", 0))
    except OSError:
        return False
    try:
        with open(descriptor, "rb") as file:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode) or info.st_size != len(content):
                return False
            return file.read(len(content) + 1) == content
    except OSError:
        return False


@dataclass
class _PulledTask:
    context: Any  # flwr.app.Context
    run: Any  # flwr.supercore.run.Run
    fab: Any  # flwr.supercore.fab.Fab


class AppGate:
    """The gate inside Flower's ClientApp process: :meth:`pull_task_input` and
    :meth:`install_from_fab` stand in for the functions of the same names in
    ``flwr.supernode.runtime.run_clientapp`` (:func:`install_gate`).

    ``pull_task_input`` is Flower's, keeping what it pulled; ``install_from_fab`` checks the
    pulled bundle (:func:`check_app_bundle`) against the node's policy and that the run names
    the app the bundle holds, installs it if its folder does not exist yet, and then, for
    every message, that the folder Flower will load the ClientApp from (named by the run's app
    id, version and hash) holds exactly the bundle's files (:func:`check_installed_app`). Every
    refusal raises inside ``run_clientapp``'s ``try``, after the message was pulled and before
    any module of the bundle is imported, so the server gets an error reply with
    :data:`APP_REFUSED_TEXT`.

    Parameters
    ----------
    pull : Callable
        Flower's ``pull_task_input``.
    install : Callable
        Flower's ``install_from_fab``.
    environ : Mapping[str, str] or None
        The environment the policy is read from (default ``os.environ``).
    """

    def __init__(
        self,
        pull: Callable[[Any], tuple[Any, Any, Any, Any]],
        install: Callable[..., Path],
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._pull = pull
        self._install = install
        self._environ = environ
        self._pulled: _PulledTask | None = None

    def pull_task_input(self, client: Any) -> tuple[Any, Any, Any, Any]:
        """Flower's ``pull_task_input`` (its object pulls re-asked promptly:
        :class:`~fedparity.mechanisms.protocol.object_pulls.PromptObjectPulls`); keeps the
        context, run and bundle for the check."""
        message, context, run, fab = self._pull(PromptObjectPulls(client))
        self._pulled = _PulledTask(context, run, fab)
        return message, context, run, fab

    def check(self, task: _PulledTask) -> str:
        """The digest of ``task``'s bundle if the node's policy allows it, else NodeRefusal."""
        try:
            policy = node_policy(task.context.node_config, self._environ)
        except ValueError as error:  # an unreadable policy: the node's operator must fix it
            log(WARNING, "app gate: refused every app bundle: %s", error)
            raise NodeRefusal(APP_REFUSED_TEXT) from None
        return check_app_bundle(task.fab.content, task.fab.hash_str, policy)

    def install_from_fab(
        self, fab_file: Path | bytes, install_dir: Path | None = None, skip_prompt: bool = False
    ) -> Path:
        """Flower's ``install_from_fab`` of the pulled bundle, if the gate lets it through.

        Returns the folder Flower loads the ClientApp from, checked for this message to hold
        exactly the approved bundle's files (:func:`check_installed_app`; about 5 ms for
        fedparity's 190 files). Flower's installer runs only when that folder does not exist:
        it unpacks into a temporary folder beside it, renamed into place when complete, so a
        ClientApp running at the same time sees the whole folder or none. From here on Python
        writes no bytecode in this process (``sys.dont_write_bytecode``): a cache written into
        the folder would not be the bundle's files, and the next message would be refused.
        """
        from flwr.common.config import get_project_dir

        task, self._pulled = self._pulled, None
        if task is None or not isinstance(fab_file, bytes) or fab_file != task.fab.content:
            log(WARNING, "app gate: refused to install a bundle that is not the pulled one")
            raise NodeRefusal(APP_REFUSED_TEXT)
        digest = self.check(task)
        try:
            files = bundle_files(fab_file)
            app = _bundle_app(files)
            loaded = get_project_dir(task.run.fab_id, task.run.fab_version, task.fab.hash_str)
        except ValueError as error:
            log(WARNING, "app gate: refused the app bundle with SHA-256 %s: %s", digest, error)
            raise NodeRefusal(APP_REFUSED_TEXT) from None
        if app != (task.run.fab_id, task.run.fab_version) or install_dir is not None:
            log(
                WARNING,
                "app gate: refused run %s: it names app %r version %r, which is not the "
                "approved bundle's (%r version %r)%s",
                task.run.run_id,
                task.run.fab_id,
                task.run.fab_version,
                *app,
                "" if install_dir is None else f", or installs it into {install_dir}",
            )
            raise NodeRefusal(APP_REFUSED_TEXT)
        if not os.path.lexists(loaded):
            log(INFO, "app gate: app bundle %s is in allowed-apps; installing it", digest)
            self._install_at(loaded, fab_file, skip_prompt)
        check_installed_app(loaded, files, digest)
        sys.dont_write_bytecode = True
        log(
            INFO,
            "app gate: app bundle %s is in allowed-apps; %s holds exactly its files",
            digest,
            loaded,
        )
        return loaded

    def _install_at(self, folder: Path, content: bytes, skip_prompt: bool) -> None:
        """Flower's installer into a temporary folder beside ``folder``, renamed to it."""
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".fedparity-install-", dir=folder.parent))
        try:
            unpacked = Path(self._install(content, staging, skip_prompt))
            try:
                os.rename(unpacked, folder)
            except OSError:
                if not os.path.lexists(folder):
                    raise
                # another ClientApp installed it meanwhile: the check reads that folder
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _bundle_app(files: Mapping[str, bytes]) -> tuple[str, str]:
    """The app id (``publisher/name``) and version in a bundle's ``pyproject.toml``, as
    Flower's installer reads them; ValueError when they cannot be read."""
    import tomllib

    from flwr.common.config import get_metadata_from_config

    try:
        config = tomllib.loads(files["pyproject.toml"].decode("utf-8"))
        fab_id, fab_version = get_metadata_from_config(config)
    except (KeyError, TypeError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"its pyproject.toml names no app and version ({error!r})") from None
    return str(fab_id), str(fab_version)


def check_flower() -> None:
    """Raise RuntimeError unless the installed Flower is the series the gate was checked
    against (:data:`CHECKED_FLOWER`) and has the functions and table the gate replaces."""
    from flwr.cli import install
    from flwr.supercore import constant
    from flwr.supercore.superexec.executor import subprocess_executor
    from flwr.supernode.runtime import run_clientapp

    found = version("flwr")
    problems = []
    if found != CHECKED_FLOWER and not found.startswith(CHECKED_FLOWER + "."):
        problems.append(f"this is Flower {found}")
    install_name = getattr(run_clientapp, "install_from_fab", None)
    if not (install_name is install.install_from_fab or isinstance(_owner(install_name), AppGate)):
        problems.append("run_clientapp.install_from_fab is not flwr.cli.install's")
    if not callable(getattr(run_clientapp, "pull_task_input", None)):
        problems.append("run_clientapp has no pull_task_input")
    if getattr(subprocess_executor, "TASK_TYPE_TO_COMMAND", None) is not getattr(
        constant, "TASK_TYPE_TO_COMMAND", ()
    ):
        problems.append("the subprocess executor does not read flwr.supercore.constant's table")
    if problems:
        raise RuntimeError(
            f"the fedparity app gate was checked against Flower {CHECKED_FLOWER}, and "
            f"{'; '.join(problems)}: refusing to start (use Flower {CHECKED_FLOWER}.x, or a "
            "fedparity release checked against this Flower)"
        )


def _owner(function: Any) -> Any:
    return getattr(function, "__self__", None)


def install_gate(environ: Mapping[str, str] | None = None) -> AppGate:
    """Put an :class:`AppGate` in front of Flower's installer in this process: replaces
    ``pull_task_input`` and ``install_from_fab`` of ``flwr.supernode.runtime.run_clientapp``
    (:func:`check_flower` first; RuntimeError if Flower is not the checked one). Idempotent."""
    from flwr.supernode.runtime import run_clientapp

    check_flower()
    current = _owner(run_clientapp.install_from_fab)
    if isinstance(current, AppGate):
        return current
    gate = AppGate(run_clientapp.pull_task_input, run_clientapp.install_from_fab, environ)
    run_clientapp.pull_task_input = gate.pull_task_input
    run_clientapp.install_from_fab = gate.install_from_fab
    return gate


def clientapp_main() -> None:
    """``fedparity-clientapp``: Flower's ``flwr-clientapp`` (same options) behind the gate."""
    try:
        install_gate()
    except RuntimeError as error:
        sys.exit(f"{CLIENTAPP_COMMAND}: {error}")
    from flwr.supernode.cli import flwr_clientapp

    flwr_clientapp()


# ------------------------------------------------------------------------- the SuperExec


def _clientapp_executable() -> str:
    """The absolute path of ``fedparity-clientapp``: beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / CLIENTAPP_COMMAND
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(CLIENTAPP_COMMAND)
    if found is None:
        raise RuntimeError(f"{CLIENTAPP_COMMAND} is not installed beside {sys.executable}")
    return str(Path(found).resolve())


def _superexec_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedparity-superexec",
        add_help=False,
        description=(
            "Flower's flower-superexec for a SuperNode started with --isolation process, whose "
            f"ClientApp processes are {CLIENTAPP_COMMAND}: they run only the app bundles whose "
            "SHA-256 is in allowed-apps of the node's privacy policy. Every other option is "
            "flower-superexec's (listed below)."
        ),
    )
    parser.add_argument(
        "--privacy-policy",
        metavar="FILE",
        help=(
            f"the node's policy file, given to the ClientApp processes as {POLICY_ENV} (a "
            "privacy-policy or policy keys in the SuperNode's --node-config take precedence)"
        ),
    )
    parser.add_argument(
        "--executor",
        default="subprocess",
        help=(
            "subprocess (Flower's: a fresh ClientApp process per message) or warm (Linux, "
            "macOS: each ClientApp process forked from a zygote that imported Flower, "
            "fedparity, torch and TenSEAL once; fedparity.clients.warm_clientapp)"
        ),
    )
    parser.add_argument(
        "--fixed-task-poll",
        action="store_true",
        help=(
            "poll the SuperNode for tasks every FLWR_SUPEREXEC_TASK_POLL_INTERVAL seconds even "
            "while none come (Flower's behaviour); by default the pause grows to a tenth of the "
            f"time since the last task, at most {IDLE_POLL_LONGEST:g} s or that interval if longer"
        ),
    )
    return parser


def install_idle_task_polls(polls: IdlePolls | None = None) -> IdlePolls:
    """Make Flower's SuperExec loop in this process pause as :class:`IdlePolls` says: its
    interval (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``) right after a task, slower while none
    come. Replaces ``time`` and ``_handle_launch_result`` (called for every task it acquired)
    in ``flwr.supercore.superexec.run_superexec``; RuntimeError for a Flower whose loop does not
    use them."""
    from flwr.supercore.superexec import run_superexec

    # Flower's own objects (a second call replaces the first one's pauses)
    launched = getattr(run_superexec, "_handle_launch_result", None)
    launched = getattr(launched, "__wrapped__", launched)
    current = getattr(run_superexec, "time", None)
    if not callable(launched) or not (current is time or hasattr(current, "idle_polls")):
        raise RuntimeError(
            "Flower's SuperExec loop has no time.sleep / _handle_launch_result in "
            "flwr.supercore.superexec.run_superexec: run with --fixed-task-poll"
        )
    polls = IdlePolls() if polls is None else polls
    clock = time_with_sleep(polls.sleep)
    clock.idle_polls = polls  # type: ignore[attr-defined]

    @functools.wraps(launched)
    def handle_launch_result(*args: Any, **kwargs: Any) -> Any:
        polls.activity()
        return launched(*args, **kwargs)

    run_superexec.time = clock
    run_superexec._handle_launch_result = handle_launch_result
    return polls


def superexec_main(argv: Sequence[str] | None = None) -> None:
    """``fedparity-superexec``: Flower's ``flower-superexec`` whose ClientApp command is
    ``fedparity-clientapp`` (:func:`clientapp_main`). Executors: ``subprocess`` (Flower's) or
    ``warm`` (:mod:`fedparity.clients.warm_clientapp`: the same command and gate, each process
    forked from a zygote)."""
    from flwr.supercore.cli import flower_superexec
    from flwr.supercore.constant import TASK_TYPE_TO_COMMAND, TaskType

    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = _superexec_parser()
    ours, rest = parser.parse_known_args(arguments)
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print()
        sys.argv = ["flower-superexec", "--help"]
        flower_superexec()  # prints Flower's options and exits
        return
    if ours.executor not in ("subprocess", WARM_EXECUTOR):
        parser.error(
            f"--executor must be subprocess or {WARM_EXECUTOR} (the gate runs local processes), "
            f"got {ours.executor!r}"
        )
    if ours.executor == WARM_EXECUTOR:
        try:
            check_fork_platform()
        except RuntimeError as error:
            parser.error(str(error))
    policy_file = ours.privacy_policy or os.environ.get(POLICY_ENV)
    if policy_file:
        try:
            policy = NodePrivacyPolicy.from_file(policy_file)
        except ValueError as error:
            parser.error(f"--privacy-policy: {error}")
        os.environ[POLICY_ENV] = str(Path(policy_file).expanduser().resolve())
        if not policy.allowed_apps:
            log(
                WARNING,
                "fedparity-superexec: %s has no allowed-apps: every bundle is refused",
                policy.source,
            )
    try:
        check_flower()
        command = _clientapp_executable()
    except RuntimeError as error:
        sys.exit(f"fedparity-superexec: {error}")
    TASK_TYPE_TO_COMMAND[TaskType.CLIENT_APP] = command
    if not ours.fixed_task_poll:
        try:
            install_idle_task_polls()
        except RuntimeError as error:
            sys.exit(f"fedparity-superexec: {error}")
    if ours.executor == WARM_EXECUTOR:
        try:
            install_warm_executor(command)
        except RuntimeError as error:
            sys.exit(f"fedparity-superexec: {error}")
        log(INFO, "fedparity-superexec: ClientApps run as %s forked from a zygote", command)
    else:
        log(INFO, "fedparity-superexec: ClientApps run as %s (app gate)", command)
    sys.argv = ["flower-superexec", *rest, "--executor", "subprocess"]
    flower_superexec()


# ---------------------------------------------------------------------------- the hash


def app_bundle_hash(path: str | os.PathLike[str]) -> str:
    """The SHA-256 hex digest Flower gives an app bundle: of a ``.fab`` file's bytes, or of the
    bundle ``flwr run PATH`` / ``flwr build --app PATH`` builds from an app folder (Flower's
    builder is deterministic: sorted files, fixed timestamps). ValueError for anything else."""
    target = Path(path).expanduser()
    if target.is_dir():
        from flwr.cli.build import build_fab_from_disk

        try:
            return _sha256(build_fab_from_disk(target))
        except Exception as error:  # noqa: BLE001 - Flower's own message names the problem
            raise ValueError(f"{target}: not a Flower app folder ({error})") from None
    if not target.is_file():
        raise ValueError(f"{target}: no such file or folder")
    content = target.read_bytes()
    try:
        with zipfile.ZipFile(io.BytesIO(content)) as bundle:
            is_bundle = ".info/CONTENT" in bundle.namelist()
    except zipfile.BadZipFile:
        is_bundle = False
    if not is_bundle:
        raise ValueError(f"{target}: not a Flower app bundle (.fab)")
    return _sha256(content)


def app_hash_main(argv: Sequence[str] | None = None) -> None:
    """``fedparity-app-hash PATH...``: one line ``<sha256>  <PATH>`` per bundle or app folder."""
    parser = argparse.ArgumentParser(
        prog="fedparity-app-hash",
        description=(
            "Print the SHA-256 of Flower app bundles, the values of the allowed-apps key of a "
            "node's privacy policy: of a .fab file (flwr build), or of the bundle flwr run "
            "builds from an app folder."
        ),
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="a .fab file or an app folder")
    args = parser.parse_args(argv)
    for path in args.paths:
        try:
            print(f"{app_bundle_hash(path)}  {path}")
        except ValueError as error:
            parser.error(str(error))
