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
  unless the run names the app the bundle holds. A refusal reaches the server as the fixed
  sentence :data:`APP_REFUSED_TEXT`; nothing of the bundle was written or loaded;
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
import sys
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
    "INSTALLED_MARKER",
    "AppGate",
    "app_bundle_hash",
    "app_hash_main",
    "check_app_bundle",
    "check_flower",
    "clientapp_main",
    "install_gate",
    "install_idle_task_polls",
    "installed_by_gate",
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


#: The file in an app's folder (``$FLWR_HOME/apps/...``) that names the SHA-256 of the bundle
#: the gate installed there.
INSTALLED_MARKER = ".fedparity-bundle-sha256"


def installed_by_gate(folder: Path) -> str | None:
    """The SHA-256 of the approved bundle the gate installed into ``folder`` (None: none, or
    not by the gate).

    Flower's installer unpacks a bundle into a temporary folder, checks its manifest and then,
    when the app's folder exists already, keeps that folder and drops the new copy: about 0.1 s
    of CPU for every message. The gate writes this marker once, after Flower installed an
    approved bundle into a folder that did not exist, and skips Flower's installer when the
    marker names the bundle just checked: the folder is then the one Flower would have kept.
    The bundle's bytes are still hashed and checked against ``allowed-apps`` for every
    message."""
    try:
        text = (folder / INSTALLED_MARKER).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else None


def _mark_installed(folder: Path, digest: str) -> None:
    marker = folder / INSTALLED_MARKER
    partial = folder / f"{INSTALLED_MARKER}.{os.getpid()}"
    try:
        partial.write_text(digest + "\n", encoding="ascii")
        os.replace(partial, marker)
    except OSError as error:  # only the next message's speed depends on it
        log(WARNING, "app gate: could not mark %s as installed: %s", folder, error)


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
    pulled bundle (:func:`check_app_bundle`) against the node's policy before calling Flower's
    installer, and afterwards that the folder Flower will load the ClientApp from (named by the
    run's app id, version and hash) is the one the approved bundle was installed to. Every
    refusal raises inside ``run_clientapp``'s ``try``, after the message was pulled, so the
    server gets an error reply with :data:`APP_REFUSED_TEXT`.

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
        """Flower's ``install_from_fab`` of the pulled bundle, if the gate lets it through."""
        from flwr.common.config import get_project_dir

        task, self._pulled = self._pulled, None
        if task is None or not isinstance(fab_file, bytes) or fab_file != task.fab.content:
            log(WARNING, "app gate: refused to install a bundle that is not the pulled one")
            raise NodeRefusal(APP_REFUSED_TEXT)
        digest = self.check(task)
        try:
            loaded = get_project_dir(task.run.fab_id, task.run.fab_version, task.fab.hash_str)
        except ValueError:
            loaded = None
        if install_dir is None and loaded is not None and installed_by_gate(loaded) == digest:
            log(INFO, "app gate: app bundle %s is in allowed-apps; installed at %s", digest, loaded)
            return loaded
        log(INFO, "app gate: app bundle %s is in allowed-apps; installing it", digest)
        fresh = install_dir is None and loaded is not None and not loaded.exists()
        installed = Path(self._install(fab_file, install_dir, skip_prompt))
        if loaded is None or loaded.resolve() != installed.resolve():
            log(
                WARNING,
                "app gate: refused run %s: it names app %r version %r, which is not the "
                "approved bundle's (installed at %s)",
                task.run.run_id,
                task.run.fab_id,
                task.run.fab_version,
                installed,
            )
            raise NodeRefusal(APP_REFUSED_TEXT)
        if fresh:  # Flower unpacked and checked this bundle into the folder just now
            _mark_installed(installed, digest)
        return installed


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
