"""A pre-forked (zygote) ClientApp launcher for ``fedparity-superexec --executor warm``.

Flower 1.41's SuperExec starts a fresh ClientApp process for every message a SuperNode
receives (its subprocess executor); each one pays the interpreter's start and the imports of
Flower, fedparity, torch and TenSEAL, about 1-4 s of CPU, before it reads its message.
Flower's own warm executors serve AgentApp, Model and Connector tasks only, not ClientApps.

The warm executor keeps one **zygote** process per SuperExec: a fresh interpreter (started
like any ClientApp process, from the SuperExec's environment and working folder) that imports
once what a ClientApp needs (:data:`DEFAULT_PRELOAD`) and then waits. For each ClientApp task
the SuperExec sends it the command line the subprocess executor would have run (runtime API
address, task token, TLS options, parent pid: :func:`clientapp_args`); the zygote forks, and
the child runs ``fedparity-clientapp``'s entry point
(:func:`~fedparity.clients.app_gate.clientapp_main`: Flower's ``flwr-clientapp`` behind the app
gate, the same bundle check) with that command line, then exits. The zygote reaps its
children; the SuperExec restarts a zygote that died, and starts the ClientApp as a fresh
process (Flower's subprocess executor, logged) whenever the zygote cannot fork one. Every other
task type goes to the subprocess executor.

Security property -- **clean fork**: every ClientApp still runs in its own process, forked from
the zygote's state right after its imports, never from a process that ran a ClientApp; nothing
of one message's run (keys, data, noise, installed bundles, imported app modules) reaches the
next except what Flower's Context carries, as with the subprocess executor. The zygote never
pulls a task, holds a token, opens a connection, reads the node's policy or data, starts a
thread or draws randomness (:func:`zygote_main` refuses to fork when it has a second Python
thread). Randomness in a child: a fork copies every generator the zygote holds. fedparity's
privacy noise and secrets come from the operating system per use (``secure_generator`` keys
AES-CTR with :func:`os.urandom` when called; ``secrets``; X25519 keys from OpenSSL, which
reseeds in a forked child), and before any ClientApp code each child reseeds from the operating
system the global generator of every preloaded library that keeps one, through one registry
(:data:`FORK_RESEEDS`, run by :func:`reseed_forked_generators`): torch's CPU one, NumPy's
legacy one and SymPy's; CPython reseeds :mod:`random` itself. It is a call in the
child, not an :func:`os.register_at_fork` hook: a hook's error is only printed (the child would
keep the zygote's stream), and a hook would also reseed the processes a ClientApp forks itself,
which a fresh interpreter does not. ``tests/test_warm_clientapp.py`` finds every generator the
preloaded modules hold (module and class attributes) and checks that each child's differs from
the zygote's and its siblings' (SymPy's ``Dummy._prng``, used once at import, excepted). Until
review M2 (2026-11-28) torch's was shared by every child. Native thread pools: the zygote runs
no torch operation (torch's OpenMP pool is never started before a fork); the OpenBLAS pools that
NumPy and SciPy start at import stop and restart across a fork (their own fork handlers).

Linux and macOS only (``os.fork``); elsewhere the option is refused.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from logging import DEBUG, INFO, WARNING
from types import ModuleType
from typing import Any

from flwr.common import log

__all__ = [
    "DEFAULT_PRELOAD",
    "FORK_RESEEDS",
    "WARM_EXECUTOR",
    "WarmClientAppExecutor",
    "check_fork_platform",
    "clientapp_args",
    "install_warm_executor",
    "reseed_forked_generators",
    "skip_torch_library_finalizers",
    "torch_library_finalizers",
    "zygote_main",
]

#: The ``--executor`` value of ``fedparity-superexec`` that selects this launcher.
WARM_EXECUTOR = "warm"
#: What the zygote imports before it forks (a module that is not installed is skipped). Besides the
#: ClientApp's own modules, what its handlers import lazily on first use, measured in forked
#: ClientApps (2026-11-27): torch imports TorchDynamo, and with it SymPy, when ``torch.func``
#: computes per-user gradients (FPFL: 0.9 s; models are built without ``skip_init`` and trained
#: without a ``torch.optim`` optimizer, which would load them too); httpcore (the Runtime API
#: client's transport) and the module :func:`~fedparity.clients.app_gate.check_flower` reads; and
#: Opacus, whose accountant an FPFL node's setup runs once per run (0.2-0.27 CPU-s of importing,
#: measured 2026-11-27 in forked children), imported through
#: :func:`~fedparity.mechanisms.privacy.opacus_accounting.import_opacus` so that its
#: ``logging.basicConfig`` leaves no handler on the root logger the children inherit.
DEFAULT_PRELOAD = (
    "flwr.supernode.cli.flwr_clientapp",
    "flwr.supernode.runtime.run_clientapp",
    "flwr.supercore.superexec.executor.subprocess_executor",
    "flwr.cli.install",
    "httpcore",
    "fedparity.clients.app_gate",
    "fedparity.clients.app",
    "torch",
    "torch._dynamo",
    "tenseal",
    "scipy.stats",
    "dp_accounting.pld.privacy_loss_distribution",
    "opacus.accountants",
)
#: Seconds the SuperExec waits for the zygote to be ready (its imports) and to answer a fork.
ZYGOTE_TIMEOUT = 120.0
_ZYGOTE_CODE = "from fedparity.clients.warm_clientapp import zygote_main; zygote_main()"


def check_fork_platform() -> None:
    """RuntimeError unless this platform can fork a ClientApp (Linux, macOS)."""
    if not hasattr(os, "fork") or not sys.platform.startswith(("linux", "darwin")):
        raise RuntimeError(
            f"--executor {WARM_EXECUTOR} forks ClientApp processes and needs Linux or macOS "
            f"(os.fork); this is {sys.platform}: use --executor subprocess"
        )


def clientapp_args(spec: Any, command: str) -> list[str]:
    """The command line Flower's subprocess executor runs for the ``ExecutionSpec`` ``spec``
    (``flwr.supercore.superexec.executor.subprocess_executor``), with ``command`` first."""
    from flwr.supercore.constant import TASK_TYPE_TO_APPIO_API_ADDRESS_ARG

    args = [
        command,
        TASK_TYPE_TO_APPIO_API_ADDRESS_ARG[spec.task_type],
        spec.runtime_api_address,
        "--token",
        spec.token,
    ]
    if spec.insecure:
        args.append("--insecure")
    elif spec.root_certificates_path is not None:
        args.extend(["--root-certificates", spec.root_certificates_path])
    if spec.parent_pid is not None:
        args.extend(["--parent-pid", str(spec.parent_pid)])
    if spec.runtime_dependency_install:
        args.append("--allow-runtime-dependency-installation")
    return args


# ----------------------------------------------------------------------------- the zygote


def _preload(modules: Sequence[str]) -> list[str]:
    loaded = []
    for name in modules:
        try:
            if name.split(".")[0] == "opacus":
                from ..mechanisms.privacy.opacus_accounting import import_opacus

                import_opacus(name)
            else:
                importlib.import_module(name)
            loaded.append(name)
        except ImportError as error:
            log(INFO, "warm ClientApp zygote: not preloading %s (%s)", name, error)
    return loaded


def _reap() -> None:
    """Collect every child of the zygote that has exited (no zombies); logs (DEBUG) each
    one's exit code and CPU time."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        log(
            DEBUG,
            "warm ClientApp zygote: process %d exited with code %d after %.2f s of CPU",
            pid,
            os.waitstatus_to_exitcode(status),
            usage.ru_utime + usage.ru_stime,
        )


def torch_library_finalizers() -> list[weakref.finalize]:
    """The live ``weakref.finalize`` objects of torch's operator libraries: one per
    ``torch.library.Library``, calling ``torch.library._del_library`` (none before torch is
    imported). Read from CPython's registry of live finalizers."""
    delete = getattr(sys.modules.get("torch.library"), "_del_library", None)
    if delete is None:
        return []
    registry = getattr(weakref.finalize, "_registry", {})
    return [f for f, info in list(registry.items()) if getattr(info, "func", None) is delete]


def skip_torch_library_finalizers() -> int:
    """Stop torch's operator-library finalizers from running at this process's exit; returns
    how many were stopped.

    Importing torch (and TorchDynamo, which the zygote preloads) makes about 170
    ``torch.library.Library`` objects, each with a ``weakref.finalize`` that deregisters its
    operators when the interpreter exits (:func:`torch_library_finalizers`). A forked ClientApp
    is about to end with ``os._exit``: deregistering operators in it changes nothing outside it,
    and cost 0.04 CPU-s of its 0.26 (measured 2026-11-27, 10 SuperNodes, FPFL). Every other
    exit function and finalizer (temporary folders, log handlers, Flower's) still runs.
    """
    stopped = [finalizer for finalizer in torch_library_finalizers() if finalizer.atexit]
    for finalizer in stopped:
        finalizer.atexit = False
    return len(stopped)


def _reseed_torch(torch: ModuleType) -> None:
    """torch's default CPU generator from a nondeterministic seed, as a fresh interpreter's.

    Not ``torch.seed()``, which also queues a seed for every accelerator's generators and formats
    a stack trace for each (2-3 ms per child): a CUDA generator first made in the child seeds
    itself nondeterministically, as in a fresh interpreter, and a child of a process that
    initialised CUDA cannot use CUDA at all (torch's "bad fork" refusal), so no CUDA stream is
    shared; should CUDA be initialised in the child all the same, its generators are reseeded.
    """
    torch.default_generator.seed()
    if torch.cuda.is_initialized():
        torch.cuda.seed_all()


#: The registry of fork-time reseeding: for each library that keeps a global random generator
#: (its module), what reseeds that generator from the operating system's entropy, as a fresh
#: interpreter seeds it at import. A forked child inherits the zygote's generators as they are;
#: :func:`_run_child` runs every entry whose module the zygote imported
#: (:func:`reseed_forked_generators`) before any ClientApp code. torch: :func:`_reseed_torch`.
#: NumPy: the legacy global ``RandomState`` (``default_rng()`` draws fresh entropy per call).
#: SymPy (TorchDynamo's): its two module ``Random`` objects. Python's :mod:`random` needs no
#: entry: CPython reseeds it in every forked child (``random`` registers ``_inst.seed`` with
#: :func:`os.register_at_fork`). A library preloaded later that keeps a global generator gets an
#: entry here; ``tests/test_warm_clientapp.py`` finds every generator the preloaded modules hold
#: and fails on any that a child inherits unchanged.
FORK_RESEEDS: dict[str, Callable[[ModuleType], object]] = {
    "torch": _reseed_torch,
    "numpy.random": lambda numpy_random: numpy_random.seed(),
    "sympy.core.random": lambda sympy_random: sympy_random.seed(),
}


def reseed_forked_generators() -> list[str]:
    """Reseed from the operating system the global generator of every library in
    :data:`FORK_RESEEDS` that this process imported (in a forked child, before any of its code).

    Returns
    -------
    list[str]
        The modules whose generators were reseeded.
    """
    reseeded = []
    for name, reseed in FORK_RESEEDS.items():
        module = sys.modules.get(name)
        if module is not None:
            reseed(module)
            reseeded.append(name)
    return reseeded


def _run_child(argv: list[str], quiet: bool, closing: Sequence[int]) -> None:
    """In the forked child: become ``fedparity-clientapp`` with ``argv``; never returns."""
    code: int = 1
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)  # the zygote's stdin is the SuperExec's request pipe
        if quiet:  # the subprocess executor's suppress_output
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
        for fd in {devnull, *closing} - {0, 1, 2}:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        reseed_forked_generators()  # a fresh process seeds them from the OS: so does a child
        sys.argv = list(argv)
        from .app_gate import clientapp_main

        clientapp_main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a child must never return into the zygote's loop
        traceback.print_exc()
    finally:
        try:
            skip_torch_library_finalizers()
            atexit._run_exitfuncs()  # what a process's normal exit runs
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve(request_fd: int, reply_fd: int) -> None:
    """The zygote's loop: one JSON request per line on ``request_fd``, one JSON reply per
    request on ``reply_fd``; ends when the SuperExec closes the request pipe."""
    buffer = b""
    while True:
        _reap()
        ready, _, _ = select.select([request_fd], [], [], 1.0)
        if not ready:
            continue
        chunk = os.read(request_fd, 65536)
        if not chunk:
            return  # the SuperExec is gone
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            reply = _fork_one(line, request_fd, reply_fd)
            os.write(reply_fd, json.dumps(reply).encode() + b"\n")


def _fork_one(line: bytes, request_fd: int, reply_fd: int) -> dict[str, Any]:
    try:
        request = json.loads(line)
        argv = [str(part) for part in request["argv"]]
        quiet = bool(request.get("quiet", False))
    except (ValueError, KeyError, TypeError) as error:
        return {"error": f"unreadable request: {error}"}
    if threading.active_count() != 1:  # a thread's state (and locks) would be copied half-way
        return {"error": f"the zygote runs {threading.active_count()} threads; not forking"}
    try:
        pid = os.fork()
    except OSError as error:
        return {"error": f"fork failed: {error}"}
    if pid == 0:
        _run_child(argv, quiet, (request_fd, reply_fd))
    return {"pid": pid}


def zygote_main(argv: Sequence[str] | None = None) -> None:
    """The zygote process: ``--reply-fd N [--preload A,B,...]``; requests on stdin."""
    import argparse

    parser = argparse.ArgumentParser(prog="fedparity warm ClientApp zygote")
    parser.add_argument("--reply-fd", type=int, required=True)
    parser.add_argument("--preload", default=",".join(DEFAULT_PRELOAD))
    args = parser.parse_args(argv)
    check_fork_platform()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the SuperExec stops it (EOF or SIGTERM)
    start = time.monotonic()
    loaded = _preload([name for name in args.preload.split(",") if name])
    gc.collect()
    # The imported objects go to the collector's permanent generation (as
    # fedparity.clients.process.freeze_warm_heap does after a warm-up): a child's collections
    # neither scan them nor copy their pages.
    gc.freeze()
    ready = {
        "ready": os.getpid(),
        "preloaded": loaded,
        "seconds": round(time.monotonic() - start, 2),
        "threads": threading.active_count(),
    }
    os.write(args.reply_fd, json.dumps(ready).encode() + b"\n")
    _serve(0, args.reply_fd)


# -------------------------------------------------------------------- the SuperExec side


class _Zygote:
    """The SuperExec's handle of one zygote process."""

    def __init__(self, preload: Sequence[str]) -> None:
        read_fd, write_fd = os.pipe()
        try:
            self.process = subprocess.Popen(  # noqa: S603 - this interpreter, fixed code
                [sys.executable, "-P", "-c", _ZYGOTE_CODE, "--reply-fd", str(write_fd)]
                + ["--preload", ",".join(preload)],
                stdin=subprocess.PIPE,
                pass_fds=(write_fd,),
            )
        finally:
            os.close(write_fd)
        self._replies = read_fd
        self._buffer = b""
        self.ready: dict[str, Any] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def _line(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from the zygote in {timeout:.0f} s")
            ready, _, _ = select.select([self._replies], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self._replies, 65536)
                if not chunk:
                    raise EOFError(f"the zygote exited (code {self.process.wait()})")
                self._buffer += chunk
            elif not self.alive():
                raise EOFError(f"the zygote exited (code {self.process.returncode})")
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self._line(timeout)
            log(
                INFO,
                "warm ClientApp launcher: zygote %d ready in %.1f s (preloaded %s)",
                self.pid,
                self.ready.get("seconds", 0.0),
                ", ".join(self.ready.get("preloaded", [])),
            )
        return self.ready

    def fork(self, argv: Sequence[str], quiet: bool, timeout: float) -> int:
        self.wait_ready(timeout)
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"argv": list(argv), "quiet": quiet}).encode() + b"\n")
        self.process.stdin.flush()
        reply = self._line(timeout)
        if "pid" not in reply:
            raise RuntimeError(str(reply.get("error", reply)))
        return int(reply["pid"])

    def stop(self, grace: float = 5.0) -> None:
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()  # the zygote's loop ends on EOF
        except OSError:
            pass
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._replies)


class WarmClientAppExecutor:
    """A SuperExec executor (Flower's ``Executor`` protocol) whose ClientApp processes are
    forked from a zygote (module docstring); other task types, and ClientApps the zygote
    cannot fork, go to ``fallback`` (Flower's subprocess executor).

    Parameters
    ----------
    command : str
        The ClientApp command the subprocess executor runs (``fedparity-clientapp``): the
        child's ``sys.argv[0]``.
    fallback : Any
        Flower's ``SubprocessExecutor`` (or any executor).
    preload : Sequence[str]
        Modules the zygote imports (:data:`DEFAULT_PRELOAD`).
    timeout : float
        Seconds to wait for the zygote's imports and for each fork.
    """

    def __init__(
        self,
        command: str,
        fallback: Any,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        timeout: float = ZYGOTE_TIMEOUT,
    ) -> None:
        check_fork_platform()
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.command = command
        self.fallback = fallback
        self.preload = tuple(preload)
        self.timeout = timeout
        self.restarts = 0
        self._zygote: _Zygote | None = None
        self._start()

    @property
    def zygote_pid(self) -> int | None:
        """The pid of the current zygote (None while there is none)."""
        return None if self._zygote is None else self._zygote.pid

    def _start(self) -> None:
        self._zygote = _Zygote(self.preload)
        log(INFO, "warm ClientApp launcher: started zygote %d", self._zygote.pid)

    def _discard(self, reason: str) -> None:
        zygote, self._zygote = self._zygote, None
        if zygote is None:
            return
        log(WARNING, "warm ClientApp launcher: zygote %d %s", zygote.pid, reason)
        if zygote.alive():
            zygote.process.kill()
        zygote.stop(grace=1.0)

    def get_eligible_capacity(
        self,
        supported_task_types: set[Any],
        *,
        insecure: bool = False,
        root_certificates_path: str | None = None,
    ) -> tuple[set[Any], set[str]]:
        """As the subprocess executor: every task type, no capacity wait."""
        return self.fallback.get_eligible_capacity(
            supported_task_types, insecure=insecure, root_certificates_path=root_certificates_path
        )

    def wait_for_capacity(self, task_type: Any = None, **kwargs: Any) -> None:
        """As the subprocess executor: no capacity gate."""
        self.fallback.wait_for_capacity(task_type, **kwargs)

    def launch(self, spec: Any) -> Any:
        """Fork the ClientApp of ``spec`` from the zygote; anything else, and a ClientApp the
        zygote cannot fork (logged), through the subprocess executor."""
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP:
            return self.fallback.launch(spec)
        if self._zygote is None or not self._zygote.alive():
            self.reconcile()
        assert self._zygote is not None
        try:
            pid = self._zygote.fork(
                clientapp_args(spec, self.command), spec.suppress_output, self.timeout
            )
        except (OSError, EOFError, TimeoutError, RuntimeError, ValueError) as error:
            self._discard(f"could not fork a ClientApp ({error}); replacing the zygote")
            log(
                WARNING,
                "warm ClientApp launcher: task %s starts as a fresh process (subprocess "
                "executor) instead",
                spec.task_id,
            )
            return self.fallback.launch(spec)
        log(DEBUG, "warm ClientApp launcher: task %s runs in process %d", spec.task_id, pid)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Replace a zygote that exited (logged)."""
        if self._zygote is not None and not self._zygote.alive():
            self._discard(f"exited with code {self._zygote.process.returncode}")
        if self._zygote is None:
            self.restarts += 1
            self._start()

    def close(self) -> None:
        """Stop the zygote (ClientApps it forked finish on their own)."""
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.stop()


def install_warm_executor(
    command: str, preload: Sequence[str] = DEFAULT_PRELOAD
) -> Callable[..., Any]:
    """Make Flower's SuperExec in this process use :class:`WarmClientAppExecutor` for its
    subprocess executor (replaces ``get_executor`` of ``flwr.supercore.superexec.
    run_superexec``). RuntimeError on a platform without fork or a Flower whose SuperExec does
    not pick its executor there."""
    from flwr.supercore.constant import ExecutorType
    from flwr.supercore.superexec import run_superexec
    from flwr.supercore.superexec.executor import factory
    from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

    check_fork_platform()
    flower_factory = factory.get_executor
    if getattr(run_superexec, "get_executor", None) is not flower_factory:
        raise RuntimeError(
            "Flower's SuperExec does not choose its executor with "
            "flwr.supercore.superexec.executor.get_executor: the warm launcher cannot be used"
        )

    def get_executor(executor_type: Any, *args: Any, **kwargs: Any) -> Any:
        if executor_type == ExecutorType.SUBPROCESS:
            return WarmClientAppExecutor(command, SubprocessExecutor(), preload)
        return flower_factory(executor_type, *args, **kwargs)

    run_superexec.get_executor = get_executor
    return get_executor
