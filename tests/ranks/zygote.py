"""A fork server for the tests' rank processes: torch imported once, each rank a fork of it.

Starting Python and importing torch costs about 2.5 s of CPU per process on the CI machine (2 cores), and the
suite starts hundreds of rank processes: most of its CPU time went there.  The harness
(:func:`harness.spawn_ranks`) asks this server for a rank instead: the server, which imported torch,
``torch.distributed``, the runtime and what ranks import lazily (:data:`PRELOAD`) once, forks; the child takes
the rank's argv, environment, working directory and stdin/stdout/stderr (passed over the Unix socket), starts a
session of its own (so that a test's ``os.killpg`` reaches it and nothing else) and runs the rank script as
``__main__``.  Each rank is
still a real process of its own, with its own process group, sockets and gloo pairs: only the imports
are shared (copy-on-write), and nothing is initialised before the fork (no thread, no event loop, no
process group, no CUDA: the harness uses the server on gloo only).

Protocol, one connection per rank: the client sends one JSON line ``{"argv", "env", "cwd"}`` with three
file descriptors (stdin, stdout, stderr); the server answers ``pid\\n`` at once and, when the child has
exited, its exit code as asyncio reports it (negative: killed by that signal) ``code\\n``, then closes.
The server is single-threaded (a fork from a threaded process may inherit held locks): one ``select`` loop
over the listening socket, the clients and each child's pidfd.  It exits when its parent (the test
process) does.

    python tests/ranks/zygote.py SOCKET_PATH      (prints "ready" once listening)
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys


def _child(req: dict, fds: list[int], listener: socket.socket, conns: list[socket.socket]) -> None:
    """In the forked child: become the rank process described by ``req``; never returns."""
    code = 1
    try:
        listener.close()
        for c in conns:
            c.close()
        os.setsid()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("cwd"):
            os.chdir(req["cwd"])
        argv = list(req["argv"])
        script = os.path.abspath(argv[0])
        sys.argv = argv
        sys.path[0] = os.path.dirname(script)
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=unbuffered or stream is sys.stderr)  # type: ignore[attr-defined]
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException as exc:  # as the interpreter reports an uncaught exception (PyErr_Print)
            sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
            sys.last_exc = exc  # (3.12+; the runtime's exit guard reads these)
            sys.excepthook(type(exc), exc, exc.__traceback__)
            code = 1
        # what the interpreter does at exit: wait for non-daemon threads, run atexit handlers
        import atexit
        import threading

        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF if code >= 0 else 1)


#: Imported after torch, where installed: what rank processes import lazily, seconds of CPU each on the CI
#: machine.  ``torch._dynamo`` (with DTensor and FSDP, which it pulls in) comes with any ``torch.optim.Adam(W)``,
#: ``torch.compile``, FSDP or a DCP checkpoint; ``transformers.modeling_utils`` with the Hugging Face workers.
#: Importing defines classes and functions only: no thread, no process group, no device context.
PRELOAD = (
    "uvloop", "zmq", "torch.optim", "torch._dynamo", "torch._functorch.aot_autograd", "torch._dynamo.backends.debugging",
    "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.pipelining",
    "transformers", "transformers.modeling_utils",
)


def serve(path: str) -> None:
    import importlib

    import torch  # noqa: F401  (the point: imported once, before any fork)
    import torch.distributed  # noqa: F401
    import torch.nn  # noqa: F401

    import pipeloom.runtime  # noqa: F401

    for name in PRELOAD if os.environ.get("PIPELOOM_TEST_PRELOAD", "1") != "0" else ():  # (=0: the bare imports)
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optimisation only (transformers: the `hf` extra is optional)
            pass

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    conns: list[socket.socket] = []
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the client's connection)
    while True:
        if os.getppid() != parent:
            return
        ready, _, _ = select.select([listener, *conns, *children], [], [], 1.0)
        for r in ready:
            if r is listener:
                conn, _ = listener.accept()
                conns.append(conn)
            elif isinstance(r, socket.socket):
                conns.remove(r)
                try:
                    msg, fds, _, _ = socket.recv_fds(r, 1 << 20, 3)
                    req = json.loads(msg.decode())
                except (OSError, ValueError):
                    r.close()
                    continue
                if len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    r.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    for pidfd in children:
                        os.close(pidfd)
                    _child(req, fds, listener, [r, *conns, *(c for _, c in children.values())])
                for fd in fds:
                    os.close(fd)
                try:
                    r.sendall(f"{pid}\n".encode())
                except OSError:
                    pass
                children[os.pidfd_open(pid)] = (pid, r)
            else:
                pid, conn = children.pop(r)
                os.close(r)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
