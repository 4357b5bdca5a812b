"""Start real rank processes for a test and collect what they saved.

Each rank is its own process (its own session, so it and anything it spawns
can be killed as a group), started with the environment torchrun sets.  The
whole run is bounded by ``asyncio.timeout``; on any failure or timeout every
rank still alive is killed, and the error carries each rank's stderr tail.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import textwrap
import time
import sys
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("worker.py")
REPO = Path(__file__).resolve().parents[2]


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie waiting for a reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def wait_dead(pids: list[int], timeout: float = 2.0) -> list[int]:
    """Wait up to ``timeout`` seconds for every pid to end; the ones still alive."""
    end = time.monotonic() + timeout
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < end:
        time.sleep(0.02)
    return alive


def run_json_script(directory: Path, script: str, world: int, *args: str, timeout: float,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Write ``script`` to ``directory/job.py``, run it as ``world`` rank processes (:func:`spawn_ranks`), require
    every rank to exit 0, and return each rank's last line of stdout parsed as JSON, by rank."""
    job = directory / "job.py"
    job.write_text(script)
    codes, outs, errs = asyncio.run(spawn_ranks(world, [str(job), *args], timeout=timeout, env=env))
    assert codes == [0] * world, errs
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def launch_script(directory: Path, script: str, *args: str, nproc: int = 2, launch_args: tuple[str, ...] = (),
                  env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Write ``script`` to ``directory/job.py`` and run it under ``pipeloom launch --nproc-per-node nproc``
    (``launch_args`` before the script, ``args`` after it), with no ``PIPELOOM_*`` variable of this
    process leaking in (``env`` adds some); the completed process, output captured."""
    job = directory / "job.py"
    job.write_text(script)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELOOM_")}
    run_env.update(env or {})
    cmd = [sys.executable, "-m", "pipeloom.tools.cli", "launch", "--nproc-per-node", str(nproc), *launch_args, str(job), *args]
    return subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=timeout)


#: The head of a 2-rank checkpoint job script: ``nn.Linear(4, 4)`` stages under 1F1B, SGD with momentum, seed 0,
#: ``rank``, ``ck`` (``pipeloom.runtime.checkpoint``), ``train()`` (one step and one optimizer step) and
#: ``slow_next_write(seconds)``.
CKPT_JOB = """\
import json, os, sys, time, warnings, torch, pipeloom
import torch.distributed as dist
from torch import nn
from pipeloom.runtime import checkpoint as ck
rank = int(os.environ["RANK"])
torch.manual_seed(0)
pipe = pipeloom.Pipeline(lambda s: nn.Linear(4, 4), schedule="1F1B", num_microbatches=2, loss_fn=nn.functional.mse_loss)
opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
def train():
    pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
    opt.step()
    opt.zero_grad()
def slow_next_write(seconds):  # this rank's next checkpoint write blocks for `seconds` first (DCP's file writer)
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter
    real = _FileSystemWriter.write_data
    def slow(self, plan, planner):
        _FileSystemWriter.write_data = real
        time.sleep(seconds)
        return real(self, plan, planner)
    _FileSystemWriter.write_data = slow
"""


def linear_job(body: str, *, microbatches: int, rows: int, pipe_args: str, imports: str = "") -> str:
    """A 2-rank job script: ``nn.Linear(4, 4)`` stages, 1F1B, MSE loss, seed 0, ``rank``, and
    ``x``, ``y`` of ``rows`` rows, then ``body`` (dedented; ``pipe_args``: more Pipeline keywords)."""
    head = textwrap.dedent(f"""\
        import os, torch, pipeloom{imports}
        from torch import nn
        rank = int(os.environ["RANK"])
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(lambda s: nn.Linear(4, 4), schedule="1F1B", num_microbatches={microbatches},
                                 loss_fn=nn.functional.mse_loss, {pipe_args})
        x, y = torch.randn({rows}, 4), torch.randn({rows}, 4)
    """)
    return head + textwrap.dedent(body)


# ---------------------------------------------------------------- rank processes forked from a torch-loaded server

_ZYGOTE: dict[str, Any] = {}


def _use_zygote() -> bool:
    """Fork ranks from ``zygote.py`` (torch imported once) on gloo; exec a fresh interpreter on NCCL (a GPU
    context must not be shared) or where ``PIPELOOM_TEST_FORK=0`` asks for it."""
    return (os.environ.get("PIPELOOM_TEST_BACKEND", "gloo") == "gloo" and os.environ.get("PIPELOOM_TEST_FORK", "1") != "0"
            and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds"))


def _zygote_path() -> str:
    """The fork server's socket, started on first use (one per test process; it exits with it)."""
    proc = _ZYGOTE.get("proc")
    if proc is not None and proc.poll() is None:
        return _ZYGOTE["path"]
    import atexit
    import tempfile

    d = tempfile.mkdtemp(prefix="pipeloom-zygote-")
    path = os.path.join(d, "s")
    env = dict(os.environ)
    env.pop("PIPELOOM_TEST_STACKS", None)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("zygote.py")), path], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, env=env, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != b"ready":
        proc.kill()
        raise RuntimeError(f"the rank fork server did not start (said {line!r}, exit {proc.poll()})")
    _ZYGOTE.update(proc=proc, path=path)
    atexit.register(proc.kill)
    return path


class ForkedProcess:
    """A rank forked by the zygote, with what the tests use of ``asyncio.subprocess.Process``: ``pid``,
    ``returncode`` (negative: killed by that signal), ``wait()``, ``send_signal()``, ``kill()``, and the
    ``stdout``/``stderr`` stream readers."""

    def __init__(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 stdout: asyncio.StreamReader | None, stderr: asyncio.StreamReader | None) -> None:
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None
        self._writer = writer
        self._done = asyncio.ensure_future(self._exit(reader))

    async def _exit(self, reader: asyncio.StreamReader) -> None:
        line = await reader.readline()
        self.returncode = int(line) if line.strip() else -signal.SIGKILL  # (the server died: count it killed)
        self._writer.close()

    async def wait(self) -> int:
        await asyncio.shield(self._done)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


async def _pipe_reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))
    return reader


async def start_rank(argv: list[str], *, env: dict[str, str], stdout: int | None = asyncio.subprocess.PIPE,
                     stderr: int | None = asyncio.subprocess.PIPE, cwd: str | None = None) -> Any:
    """``asyncio.create_subprocess_exec(sys.executable, *argv, ...)`` in a session of its own, forked from the
    zygote where :func:`_use_zygote` says so (same process semantics, without a fresh ``import torch``).
    ``stdout``/``stderr``: ``asyncio.subprocess.PIPE`` or ``DEVNULL``."""
    if not _use_zygote() or argv[0].startswith("-"):
        return await asyncio.create_subprocess_exec(sys.executable, *argv, env=env, stdout=stdout, stderr=stderr,
                                                    cwd=cwd, start_new_session=True)
    path = _zygote_path()
    ends: list[int] = [os.open(os.devnull, os.O_RDONLY)]
    mine: list[int | None] = []
    for how in (stdout, stderr):
        if how == asyncio.subprocess.PIPE:
            r, w = os.pipe()
            ends.append(w)
            mine.append(r)
        else:
            ends.append(os.open(os.devnull, os.O_WRONLY))
            mine.append(None)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        req = json.dumps({"argv": [os.path.abspath(argv[0]), *argv[1:]], "env": env, "cwd": cwd}).encode()
        socket.send_fds(sock, [req], ends)
    finally:
        for fd in ends:
            os.close(fd)
    sock.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    line = await reader.readline()
    if not line.strip():
        raise RuntimeError("the rank fork server closed the connection without starting the rank")
    streams = [await _pipe_reader(fd) if fd is not None else None for fd in mine]
    return ForkedProcess(int(line), reader, writer, streams[0], streams[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RanksFailed(AssertionError):
    def __init__(self, message: str, returncodes: list[int | None], stderr: list[str]) -> None:
        self.returncodes, self.stderr = returncodes, stderr
        super().__init__(message)


def rank_env(rank: int, world: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


async def _drain(stream: asyncio.StreamReader | None, into: list[bytes]) -> None:
    """Read a pipe to its end, keeping what came so far (it survives a timeout)."""
    if stream is None:
        return
    while chunk := await stream.read(65536):
        into.append(chunk)


async def run_one_rank(directory: Path, name: str, script: str, *, timeout: float) -> Any:
    """Write ``script`` to ``directory/name``, run it as a single rank and return the JSON its last stdout
    line prints (the rank must exit 0: its stderr tail otherwise)."""
    path = directory / name
    path.write_text(script)
    codes, outs, errs = await spawn_ranks(1, [str(path)], timeout=timeout)
    assert codes == [0], errs[0][-3000:]
    return json.loads(outs[0].strip().splitlines()[-1])


async def spawn_ranks(
    world: int, argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
    after: str | None = None, setup_timeout: float = 180.0,
) -> tuple[list[int | None], list[str], list[str]]:
    """Run ``python argv...`` as ``world`` ranks; return (returncodes, stdouts, stderrs).

    ``after``: ``timeout`` counts only from when every rank has printed this line to stdout (or exited), which
    must happen within ``setup_timeout`` (starting Python, importing torch and building a Pipeline take
    seconds on a loaded machine: a test that times out a wait on purpose should time the wait, not the start).

    Every rank gets ``PIPELOOM_TEST_STACKS=1``: a worker that calls
    :func:`install_stack_dump` prints all its threads' stacks on SIGUSR1.  If
    the ranks outlive ``timeout``, each is sent SIGUSR1, given a moment, and
    killed; :class:`RanksFailed` then carries every rank's stderr tail (with
    those stacks), so a hang says where each rank was.
    """
    port = free_port()
    procs: list[asyncio.subprocess.Process] = []
    outs: list[list[bytes]] = [[] for _ in range(world)]
    errs: list[list[bytes]] = [[] for _ in range(world)]
    readers: list[asyncio.Task[None]] = []
    extra = {"PIPELOOM_TEST_STACKS": "1", **(env or {})}

    def text(chunks: list[bytes]) -> str:
        return b"".join(chunks).decode(errors="replace")

    try:
        for r in range(world):
            p = await start_rank(list(argv), env=rank_env(r, world, port, extra))
            procs.append(p)
            readers += [asyncio.create_task(_drain(p.stdout, outs[r])), asyncio.create_task(_drain(p.stderr, errs[r]))]
        try:
            if after is not None:
                marker = after.encode()
                async with asyncio.timeout(setup_timeout):
                    while not all(p.returncode is not None or marker in b"".join(o) for p, o in zip(procs, outs)):
                        await asyncio.sleep(0.05)
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(p.wait() for p in procs))
                await asyncio.gather(*readers)
        except TimeoutError:
            alive = [r for r, p in enumerate(procs) if p.returncode is None]
            # (a rank that never installed the handler dies of SIGUSR1: its exit code says -10)
            for r in alive:
                try:
                    procs[r].send_signal(signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            await asyncio.sleep(2.0)
            _kill(procs)
            await _settle(procs, readers)
            codes = [p.returncode for p in procs]
            tails = "\n".join(f"--- rank {r} (exit {c}{', was still running' if r in alive else ''}) ---\n{text(e)[-6000:]}"
                              for r, (c, e) in enumerate(zip(codes, errs)))
            raise RanksFailed(f"ranks {alive} still running after {timeout:.0f} s; their stacks at that moment:\n{tails}",
                              codes, [text(e) for e in errs]) from None
        return [p.returncode for p in procs], [text(o) for o in outs], [text(e) for e in errs]
    finally:
        _kill(procs)
        await _settle(procs, readers)


def _kill(procs: list[asyncio.subprocess.Process]) -> None:
    # every rank's session, also where the rank itself has exited (a child of it may hold a pipe)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


async def _settle(procs: list[asyncio.subprocess.Process], readers: list[asyncio.Task[None]]) -> None:
    for p in procs:
        if p.returncode is None:
            try:
                await asyncio.wait_for(p.wait(), 5)
            except (asyncio.TimeoutError, ProcessLookupError):
                pass
    for t in readers:
        if not t.done():
            try:
                await asyncio.wait_for(t, 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                t.cancel()


def init_backend() -> str:
    """In a rank process: the job's process group, on the backend the tests ask for (``PIPELOOM_TEST_BACKEND``:
    gloo by default; nccl runs the same cases on GPUs, one per rank); returns the backend's name."""
    import torch
    import torch.distributed as dist

    backend = os.environ.get("PIPELOOM_TEST_BACKEND", "gloo")
    if backend == "nccl":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dist.init_process_group("gloo")
    return backend



async def run_job(world: int, worker: Any, cases: list[dict[str, Any]], out: Any, ckroot: Any,
                  timeout: float) -> dict[str, list[dict[str, Any]]]:
    """Run ``worker`` on ``world`` ranks over ``cases`` (written to ``out/job.json`` with ``out`` and ``ckroot``);
    each rank writes ``out/{case id}-rank{r}.json``: returned by case id, one dict per rank.  Any rank that does
    not exit 0 fails the job with every rank's stderr tail (the adversarial sweeps' workers)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps({"cases": cases, "out": str(out), "ckroot": str(ckroot)}))
    codes, _, errs = await spawn_ranks(world, [str(worker), str(out / "job.json")], timeout=timeout)
    if any(c != 0 for c in codes):
        tails = "\n".join(f"--- rank {r} (exit {c}) ---\n{e[-3000:]}" for r, (c, e) in enumerate(zip(codes, errs)))
        raise RanksFailed(f"ranks failed: exit codes {codes}\n{tails}", codes, errs)
    return {c["id"]: [json.loads((out / f"{c['id']}-rank{r}.json").read_text()) for r in range(world)] for c in cases}



def serve_job(run: Any, *, empty: dict[str, Any] | None = None, hard_exit: bool = False) -> None:
    """A sweep worker's main (the other side of :func:`run_job`): read the job named on the command line, join the
    gloo group, and for each case write ``run(case, job, rank)``'s result dict (or the exception it raised, as
    ``errors``, with ``empty``'s other fields) with its ``seconds`` to ``out/{case id}-rank{rank}.json``, the ranks
    in step between cases.  ``hard_exit``: end with ``os._exit(0)`` once every result is written, not by
    destroying the group (a case that failed on purpose may leave gloo receives posted in its Pipeline's groups,
    and finalizing them at exit would end the process from C++)."""
    import time
    import traceback

    import torch
    import torch.distributed as dist

    install_stack_dump()
    with open(sys.argv[1]) as f:
        job = json.load(f)
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for cfg in job["cases"]:
        print(f"rank {rank}: case {cfg['id']}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            result = run(cfg, job, rank)
        except Exception as exc:  # noqa: BLE001 - recorded for the test to show
            result = {"diffs": {}, "errors": [f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"],
                      **(empty or {})}
        result["seconds"] = time.perf_counter() - t0
        with open(os.path.join(job["out"], f"{cfg['id']}-rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    if hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def install_stack_dump() -> None:
    """In a rank process: print every thread's stack on SIGUSR1 (the harness sends it on a timeout)."""
    if os.environ.get("PIPELOOM_TEST_STACKS") == "1":
        import faulthandler

        def actors(signum: int, frame: Any) -> None:
            # Runs when the main thread next executes Python (the event loop wakes for it);
            # faulthandler below prints the raw stacks at once, even from inside C code.
            # os.write, not print: print may be re-entered if the signal hit a write to stderr.
            try:
                mod = sys.modules.get("pipeloom.runtime.actor")
                text = mod.debug_dump() if mod is not None else "no pipeloom actor imported"
            except BaseException as exc:  # noqa: BLE001 - a debugging aid must not disturb the rank
                text = f"(no actor state: {exc!r})"
            try:
                os.write(2, (text + "\n").encode(errors="replace"))
            except OSError:
                pass

        signal.signal(signal.SIGUSR1, actors)
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)


async def run_ranks(world: int, cases: list[dict[str, Any]], out: Path, *, timeout: float = 120.0,
                    worker: Path | str = WORKER) -> dict[str, list[dict[str, Any]]]:
    """Run every case on one pool of ``world`` ranks (``worker``: the rank script); return case id -> each rank's saved result."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    path = out / "job.json"
    path.write_text(json.dumps({"cases": cases, "out": str(out)}))
    codes, _, errs = await spawn_ranks(world, [str(worker), str(path)], timeout=timeout)
    if any(c != 0 for c in codes):
        tails = "\n".join(f"--- rank {r} (exit {c}) ---\n{e[-3000:]}" for r, (c, e) in enumerate(zip(codes, errs)))
        raise RanksFailed(f"ranks failed: exit codes {codes}\n{tails}", codes, errs)
    return {
        c["id"]: [torch.load(out / f"{c['id']}-rank{r}.pt", weights_only=False) for r in range(world)] for c in cases
    }
