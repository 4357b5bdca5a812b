"""``pipeloom launch`` takes real torchrun command lines: a table of them, and the facts a rank sees.

Each row is a command line as it is given to ``torchrun`` (the flags after the
command name), run through a real ``pipeloom launch`` process on a tiny probe
script, with the facts every rank must see: its torchrun variables, its
``sys.argv``, what was run (file, module, interpreter) and the launcher's exit
status.  The expected facts are those real ``torchrun`` (torch 2.13) gave for the
same command line in a sweep that ran both side by side; they are asserted
directly here, because starting torchrun costs about two seconds a run.  Where
pipeloom differs by design (a missing script is a usage error, exit 2, before
any rank starts; a rank killed by a signal is exit 3), the row says so and the
README's "What still differs from torchrun" lists it.

The probe does not import torch (a second per process on this machine), except
in the one row that checks that ``init_process_group("gloo")`` through
``env://`` gets the world the variables promise.

Rows marked with a finding failed before the fix named there:

* a script that is a directory with ``__main__.py`` (or a zip) is run by python, as
  under torchrun, not refused as "script not found";
* ``PYTHON_EXEC`` chooses the ranks' interpreter, as under torchrun;
* torchrun's ``PET_*`` environment defaults (``PET_NPROC_PER_NODE=2 torchrun
  train.py``, how Kubeflow's PyTorchJob starts torchrun) are read;
* ``--standalone`` overrides ``--rdzv-*`` flags (as torchrun's does) instead of
  refusing the command line, and gives the ranks a fresh ``TORCHELASTIC_RUN_ID``;
* ``--run-path`` hands the script its path as given;
* ``--shutdown-timeout`` is the time from SIGTERM to SIGKILL (it was ignored);
* ``--virtual-local-rank`` gives every rank ``LOCAL_RANK=0`` and its own GPU
  as ``CUDA_VISIBLE_DEVICES`` (it was accepted and ignored);
* SIGINT to the launcher (Ctrl-C) reaches the ranks as SIGINT, so a script's
  ``except KeyboardInterrupt`` / ``finally`` runs, as under torchrun (they got
  SIGTERM and died without running it);
* SIGQUIT (Ctrl-\\) is handled like SIGTERM: every rank's process group ends,
  grandchildren included (the launcher died of it and left them running);
* a SIGKILL of the launcher leaves no rank's child running (PDEATHSIG ended the
  ranks; their children ran on).

The tests at the end run real torchrun beside ``pipeloom launch`` on the same
command line (about two seconds a torchrun run) and assert the same observable
behaviour; each failed before its fix:

* a rank's whole environment is torchrun's but for the documented few
  (``TORCHELASTIC_SIGNALS_TO_HANDLE`` was missing);
* ``--standalone --nnodes 1:2`` runs one node (was refused), and
  ``--standalone`` overrides ``--master-port``/``--master-addr``/``--node-rank``
  (a given busy port was used; ``--node-rank`` was refused);
* flags may be abbreviated as torchrun's parser allows (``--redirect 3``);
* ``--nproc-per-node cpu`` counts the CPUs the launcher may run on (affinity);
* a launcher's own ``TORCHELASTIC_ERROR_FILE`` gets the root-cause rank's error
  file, with ``errorCode``, as torchrun's ``@record`` writes it;
* ``--signals-to-handle ...,SIGUSR1`` forwards SIGUSR1 to the ranks (it was
  ignored: the launcher died of the signal, the ranks with it);
* ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` is the default ``--shutdown-timeout``;
* ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` is the echoed lines' prefix;
* ``--master-addr [::1]`` (IPv6 in brackets) reaches the ranks as ``::1``.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import pid_alive as _alive, wait_dead as _wait_dead  # noqa: E402

LAUNCH = [sys.executable, "-m", "pipeloom.tools.cli", "launch"]

PROBE = textwrap.dedent(
    """\
    import json, os, sys
    KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS", "PROBE_VIA", "CUDA_VISIBLE_DEVICES"]
    rec = {k: os.environ.get(k) for k in KEYS}
    rec.update(argv=sys.argv, cwd=os.getcwd(), name=__name__, file=globals().get("__file__"),
               spec=getattr(globals().get("__spec__"), "name", None), pid=os.getpid(), environ=dict(os.environ))
    if os.environ.get("PROBE_DIST") == "1":
        from datetime import timedelta
        import torch, torch.distributed as dist
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
        t = torch.ones(1)
        dist.all_reduce(t)
        rec["dist"] = [dist.get_rank(), dist.get_world_size(), t.item()]
        dist.destroy_process_group()
    with open(os.path.join(os.environ["PROBE_OUT"], f"rank{rec['RANK']}.json"), "w") as f:
        json.dump(rec, f)
    print("probe of rank", rec["RANK"], flush=True)
    fail = os.environ.get("PROBE_FAIL", "")
    if fail.split(":")[0] == rec["RANK"]:
        how = fail.split(":")[1]
        if how.startswith("SIG"):
            import signal
            os.kill(os.getpid(), getattr(signal, how))
        sys.exit(int(how))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    """A working directory with the probe as a script, a package, a runnable directory and a zip."""
    (tmp_path / "probe.py").write_text(PROBE)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(PROBE)
    (pkg / "__main__.py").write_text(PROBE)
    (tmp_path / "notrunnable").mkdir()
    (tmp_path / "out").mkdir()
    wrapper = tmp_path / "pyexec.sh"  # a PYTHON_EXEC that marks the ranks it starts
    wrapper.write_text(f"#!/bin/sh\nPROBE_VIA=python-exec exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    yield tmp_path
    out = tmp_path / "out"
    pids = [json.loads(f.read_text())["pid"] for f in out.glob("rank*.json")]
    pids += [int(f.read_text()) for f in out.iterdir() if f.name.startswith(("pid", "child"))]
    for pid in pids:  # whatever a failed test left behind
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _env(work: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_") and k not in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")}
    env.update(PROBE_OUT=str(work / "out"), **extra)
    return env


def _launch(work: Path, args: list[str], extra: dict[str, str], timeout: float = 30.0) -> tuple[int, str, str, dict[int, dict[str, Any]]]:
    args = [a.replace("{PORT}", str(_free_port())).replace("{DIR}", str(work)) for a in args]
    proc = subprocess.run([*LAUNCH, *args], cwd=work, env=_env(work, extra), capture_output=True, text=True, timeout=timeout)
    ranks = {int(Path(f).stem[4:]): json.loads(Path(f).read_text()) for f in glob.glob(str(work / "out" / "rank*.json"))}
    return proc.returncode, proc.stdout, proc.stderr, ranks


@dataclass(frozen=True)
class Row:
    """One torchrun command line and what the ranks see under it."""

    id: str
    args: list[str]
    code: int = 0
    nproc: int = 2
    facts: dict[str, Any] = field(default_factory=dict)
    """Every rank's record has these values (``{R}`` is replaced by the rank)."""
    env: dict[str, str] = field(default_factory=dict)
    stderr: tuple[str, ...] = ()
    """Substrings of the launcher's stderr."""
    shown: tuple[int, ...] | None = None
    """The ranks whose output reaches the console (None: every rank)."""


# The facts a rank sees under torchrun for a plain 2-rank, one-node job.
ONE_NODE = {"RANK": "{R}", "LOCAL_RANK": "{R}", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "{R}", "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "default",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "OMP_NUM_THREADS": "1",
            "name": "__main__"}

ROWS = [
    # -- already matched torchrun in the sweep (kept as regressions)
    Row("standalone", ["--standalone", "--nproc-per-node=2", "probe.py", "--lr", "1e-3"],
        facts={**ONE_NODE, "argv": ["probe.py", "--lr", "1e-3"]}),
    # torchrun runs a one-node job without --master-port or an endpoint as --standalone: a fresh run id each time
    # (pipeloom said 'none'); with --master-port it is static ('none', below); an explicit --rdzv-id is kept
    Row("one-node-run-id", ["--nproc-per-node=2", "probe.py"], facts={"TORCHELASTIC_RUN_ID": "<uuid>"}),
    Row("one-node-explicit-run-id", ["--nproc-per-node=2", "--rdzv-id=myjob", "probe.py"], facts={"TORCHELASTIC_RUN_ID": "myjob"}),
    Row("underscores", ["--nproc_per_node", "2", "--max_restarts=0", "--monitor_interval", "0.2", "probe.py"],
        facts=ONE_NODE),
    Row("nnodes-1", ["--nnodes=1", "--nproc-per-node=2", "probe.py"], facts=ONE_NODE),
    Row("nnodes-1:1", ["--nnodes", "1:1", "--nproc-per-node=2", "probe.py"], facts=ONE_NODE),
    Row("module", ["--nproc-per-node=2", "-m", "pkg.mod", "a", "--b"],
        facts={**ONE_NODE, "spec": "pkg.mod", "argv": ["{DIR}/pkg/mod.py", "a", "--b"]}),
    Row("double-dash-after-script", ["--nproc-per-node=2", "probe.py", "--", "x"], facts={"argv": ["probe.py", "x"]}),  # argparse drops it, under both
    Row("double-dash-before-script", ["--nproc-per-node=2", "--", "probe.py", "x"], facts={"argv": ["probe.py", "x"]}),
    Row("flags-after-script-are-the-scripts", ["--nproc-per-node=2", "probe.py", "--nproc-per-node=3", "--standalone"],
        facts={**ONE_NODE, "argv": ["probe.py", "--nproc-per-node=3", "--standalone"]}),
    Row("no-python-sh", ["--nproc-per-node=2", "--no-python", "/bin/sh", "-c", f"exec {sys.executable} probe.py shx"],
        facts={**ONE_NODE, "argv": ["probe.py", "shx"]}),
    Row("no-python-python", ["--nproc-per-node=2", "--no-python", sys.executable, "probe.py", "npx"],
        facts={"argv": ["probe.py", "npx"]}),
    Row("omp-set-by-user", ["--nproc-per-node=2", "probe.py"], env={"OMP_NUM_THREADS": "4"}, facts={"OMP_NUM_THREADS": "4"}),
    Row("one-rank-no-omp", ["--nproc-per-node=1", "probe.py"], nproc=1, facts={"OMP_NUM_THREADS": None, "WORLD_SIZE": "1"}),
    Row("nproc-cpu", ["--nproc-per-node", "cpu", "probe.py"],
        nproc=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1),
    Row("role", ["--nproc-per-node=2", "--role", "trainer", "probe.py"], facts={"ROLE_NAME": "trainer"}),
    Row("static-master", ["--nproc-per-node=2", "--master-addr", "127.0.0.1", "--master-port", "{PORT}", "probe.py"],
        facts={**ONE_NODE, "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RUN_ID": "none"}),
    Row("static-endpoint", ["--nproc-per-node=2", "--rdzv-backend=static", "--rdzv-endpoint=localhost:{PORT}", "probe.py"],
        facts={**ONE_NODE, "MASTER_ADDR": "localhost"}),
    Row("redirect-tee-short", ["-r3", "-t3", "--log-dir", "{DIR}/logs", "--local-ranks-filter", "0", "--nproc-per-node=2", "probe.py"],
        facts=ONE_NODE, shown=(0,)),
    Row("local-ranks-filter", ["--nproc-per-node=2", "--local_ranks_filter=1", "probe.py"], shown=(1,)),
    Row("redirect-stdout-of-rank-0", ["--nproc-per-node=2", "-r", "0:1", "--log-dir", "{DIR}/logs", "probe.py"], shown=(1,)),
    Row("ignored-logs-specs", ["--nproc-per-node=2", "--logs-specs", "default", "probe.py"], facts=ONE_NODE,
        stderr=("note: --logs-specs does not apply to pipeloom launch and is ignored",)),
    Row("rank-exits-7", ["--nproc-per-node=2", "--grace", "0.5", "probe.py"], env={"PROBE_FAIL": "1:7"}, code=1,
        stderr=("job failed: rank 1 exited with code 7",)),
    # by design: torchrun exits 1 here; pipeloom 3 (infrastructure: a signal it did not send)
    Row("rank-sigkilled", ["--nproc-per-node=2", "--grace", "0.5", "probe.py"], env={"PROBE_FAIL": "1:SIGKILL"}, code=3,
        stderr=("job failed: rank 1 was killed by SIGKILL",)),
    Row("restart", ["--nproc-per-node=2", "--max-restarts", "1", "--grace", "0.5", "probe.py"], env={"PROBE_FAIL": "0:3"},
        code=1, facts={"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "1"},
        stderr=("attempt 0 failed: rank 0 exited with code 3", "restarting every rank")),
    # by design: torchrun starts the ranks and each fails (exit 1); pipeloom refuses before starting any (exit 2)
    Row("missing-script", ["--nproc-per-node=2", "missing.py"], code=2, nproc=0, stderr=("error: script not found: missing.py",)),
    Row("unknown-flag", ["--nproc-per-node=2", "--bogus-flag", "probe.py"], code=2, nproc=0,
        stderr=("unrecognized arguments: --bogus-flag",)),
    Row("module-and-no-python", ["--nproc-per-node=2", "--no-python", "-m", "pkg.mod"], code=2, nproc=0,
        stderr=("-m and --no-python exclude each other",)),
    Row("no-such-executable", ["--nproc-per-node=2", "--no-python", "no-such-exe-xyz"], code=2, nproc=0,
        stderr=("could not start rank 0",)),
    # -- findings (each failed before its fix)
    Row("script-is-a-runnable-directory", ["--nproc-per-node=2", "pkg", "x"],
        facts={**ONE_NODE, "argv": ["pkg", "x"], "file": "pkg/__main__.py"}),
    Row("script-is-a-directory-without-main", ["--nproc-per-node=2", "notrunnable"], code=2, nproc=0,
        stderr=("error: notrunnable is a directory without __main__.py",)),
    Row("python-exec", ["--nproc-per-node=2", "probe.py"], env={"PYTHON_EXEC": "{DIR}/pyexec.sh"},
        facts={**ONE_NODE, "PROBE_VIA": "python-exec"}),
    Row("pet-environment", ["probe.py"], env={"PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "0", "PET_ROLE": "pet"},
        facts={**ONE_NODE, "ROLE_NAME": "pet"}, stderr=("PET_NPROC_PER_NODE=2",)),
    Row("pet-environment-command-line-wins", ["--nproc-per-node", "1", "probe.py"], env={"PET_NPROC_PER_NODE": "2"},
        nproc=1, facts={"WORLD_SIZE": "1"}),
    Row("pet-environment-bad-value-is-named", ["probe.py"], env={"PET_NPROC_PER_NODE": "x"}, code=2, nproc=0,
        stderr=("expected an integer or 'auto', got 'x' (torchrun's environment defaults in effect: PET_NPROC_PER_NODE=x)",)),
    Row("pet-standalone-flag", ["--nproc-per-node=2", "probe.py"], env={"PET_STANDALONE": "1", "PET_RDZV_BACKEND": "c10d"},
        facts={**ONE_NODE, "TORCHELASTIC_RUN_ID": "<uuid>"}),
    Row("standalone-overrides-rdzv", ["--standalone", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:{PORT}",
                                      "--rdzv-id=job", "--nproc-per-node=2", "probe.py"],
        facts={**ONE_NODE, "TORCHELASTIC_RUN_ID": "<uuid>"}, stderr=("--standalone",)),
    # --virtual-local-rank was accepted and ignored (LOCAL_RANK the real one, every GPU visible); torchrun's agent
    # gives each rank LOCAL_RANK=0 and its own device as CUDA_VISIBLE_DEVICES (the launcher's list, by local rank)
    Row("virtual-local-rank", ["--nproc-per-node=2", "--virtual-local-rank", "probe.py"],
        facts={"LOCAL_RANK": "0", "RANK": "{R}", "CUDA_VISIBLE_DEVICES": "{R}"}),
    Row("virtual-local-rank-maps-visible-devices", ["--nproc-per-node=2", "--virtual_local_rank", "probe.py"],
        env={"CUDA_VISIBLE_DEVICES": "3, 5"}, facts={"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ("3", "5")}),
    Row("virtual-local-rank-too-few-devices", ["--nproc-per-node=2", "--virtual-local-rank", "probe.py"],
        env={"CUDA_VISIBLE_DEVICES": "3"}, code=2, nproc=0, stderr=("--virtual-local-rank: 2 ranks but CUDA_VISIBLE_DEVICES='3'",)),
    Row("no-virtual-local-rank-keeps-devices", ["--nproc-per-node=2", "probe.py"], env={"CUDA_VISIBLE_DEVICES": "3,5"},
        facts={"LOCAL_RANK": "{R}", "CUDA_VISIBLE_DEVICES": "3,5"}),
    Row("run-path", ["--nproc-per-node=2", "--run-path", "probe.py", "rp"], facts={**ONE_NODE, "argv": ["probe.py", "rp"]}),
    # -- through torch.distributed (a rendezvous in the launcher, gloo in the ranks): torchtitan's command line
    # a filter naming local ranks another node has (one command line for nodes of 8 and of 2 GPUs): torchrun
    # ignores them; pipeloom refused the command line (exit 2), now it notes them
    Row("local-ranks-filter-names-absent-ranks", ["--nproc-per-node=2", "--local-ranks-filter", "0,5", "probe.py"], shown=(0,),
        stderr=("note: --local-ranks-filter: local rank 5 not on this node (0..1): ignored",)),
    Row("redirects-name-absent-ranks", ["--nproc-per-node=2", "-r", "0:3,4:3,7:3", "--log-dir", "{DIR}/logs", "probe.py"],
        shown=(1,), stderr=("note: --redirects: local ranks 4, 7 not on this node (0..1): ignored",)),
    # torchrun: an empty filter shows every rank (pipeloom showed none)
    Row("local-ranks-filter-empty", ["--nproc-per-node=2", "--local-ranks-filter", "", "probe.py"]),
    # a node that never comes: torch's RendezvousTimeoutError has no message; the launcher says what timed out
    Row("c10d-join-timeout", ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:{PORT}",
                              "--rdzv-conf", "join_timeout=2", "probe.py"], code=2, nproc=0,
        stderr=("error: rendezvous failed: RendezvousTimeoutError: fewer than 2 node(s) joined within join_timeout (2 s",)),
    Row("c10d-endpoint-port-0", ["--nnodes=1", "--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
                                 "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "probe.py", "--job.config_file", "x.toml"], shown=(0,),
        env={"PROBE_DIST": "1"},
        facts={**ONE_NODE, "ROLE_NAME": "rank", "argv": ["probe.py", "--job.config_file", "x.toml"], "dist": ["{R}", 2, 2.0]}),
]


def _expect(value: Any, rank: int, work: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{R}", str(rank)).replace("{DIR}", str(work))
    if isinstance(value, list):
        return [int(_expect(v, rank, work)) if v == "{R}" else _expect(v, rank, work) for v in value]
    return value


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_torchrun_command_line(work: Path, row: Row) -> None:
    extra = {k: v.replace("{DIR}", str(work)) for k, v in row.env.items()}
    code, out, err, ranks = _launch(work, row.args, extra)
    assert code == row.code, err
    assert sorted(ranks) == list(range(row.nproc)), err
    for rank, record in ranks.items():
        for key, want in row.facts.items():
            got = record[key]
            if isinstance(want, tuple):  # one value per rank
                want = want[rank]
            if want == "<uuid>":
                assert got and got != "none" and len(got) == 36, (rank, key, got)
            elif key == "file" and got is not None:
                assert got.endswith(want), (rank, key, got, want)
            else:
                assert got == _expect(want, rank, work), (rank, key, got, err)
    for text in row.stderr:
        assert text in err, err
    shown = range(row.nproc) if row.shown is None else row.shown
    for rank in range(row.nproc):
        assert (f"[rank{rank}]: probe of rank {rank}\n" in out) == (rank in shown), (rank, out)


# ---------------------------------------------------------------- signals to the launcher

KBI_SCRIPT = textwrap.dedent(
    """\
    import os, subprocess, sys, time
    d, r = os.environ["PROBE_OUT"], os.environ["RANK"]
    child = subprocess.Popen(["sleep", "60"])
    open(os.path.join(d, f"child{r}"), "w").write(str(child.pid))
    open(os.path.join(d, f"pid{r}"), "w").write(str(os.getpid()))
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        open(os.path.join(d, f"interrupted{r}"), "w").write("1")  # e.g. save a checkpoint on Ctrl-C
        sys.exit(5)
    finally:
        open(os.path.join(d, f"finally{r}"), "w").write("1")
    """
)


def _start_and_signal(work: Path, sig: int, script: str = KBI_SCRIPT, flags: tuple[str, ...] = ("--grace", "3")
                      ) -> tuple[int, str, float, list[int]]:
    (work / "kbi.py").write_text(script)
    proc = subprocess.Popen([*LAUNCH, "--nproc-per-node=2", *flags, "kbi.py"], cwd=work, env=_env(work, {}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = work / "out"
    pids: list[int] = []
    try:
        end = time.monotonic() + 20
        while len(list(out.glob("pid*"))) < 2:
            assert time.monotonic() < end and proc.poll() is None, "ranks did not start"
            time.sleep(0.02)
        time.sleep(0.2)  # inside the try
        pids = [int(p.read_text()) for p in out.iterdir() if p.name.startswith(("pid", "child"))]
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
        return proc.returncode, err, time.monotonic() - t0, pids
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_reaches_the_ranks_as_sigint(work: Path) -> None:
    """torchrun forwards the SIGINT it got: the script's KeyboardInterrupt handler and finally run."""
    code, err, elapsed, pids = _start_and_signal(work, signal.SIGINT)
    assert code == 130, err
    names = sorted(p.name for p in (work / "out").iterdir())
    assert {"interrupted0", "interrupted1", "finally0", "finally1"} <= set(names), (names, err)
    assert elapsed < 3.0, f"the ranks acted on SIGINT at once, yet the launcher took {elapsed:.2f} s"
    assert "pipeloom launch: stopped by SIGINT; terminated ranks 0, 1" in err
    assert not _wait_dead(pids, timeout=1.0), "orphans left behind"


def test_sigquit_stops_every_rank_and_its_children(work: Path) -> None:
    """torchrun handles SIGQUIT as a death signal; so does pipeloom (exit 131), and nothing is left running."""
    code, err, elapsed, pids = _start_and_signal(work, signal.SIGQUIT)
    assert code == 128 + signal.SIGQUIT, err
    assert "pipeloom launch: stopped by SIGQUIT; terminated ranks 0, 1" in err
    assert not _wait_dead(pids, timeout=1.0), "orphans left behind"


SAVE_ON_SIGTERM = textwrap.dedent(
    """\
    import os, signal, sys, time
    d, r = os.environ["PROBE_OUT"], os.environ["RANK"]

    def save(signum, frame):  # e.g. a checkpoint on preemption: it takes a while
        time.sleep(1.5)
        open(os.path.join(d, f"saved{r}"), "w").write("1")
        sys.exit(0)

    signal.signal(signal.SIGTERM, save)
    open(os.path.join(d, f"pid{r}"), "w").write(str(os.getpid()))
    time.sleep(60)
    """
)


def test_shutdown_timeout_gives_the_ranks_time_to_save(work: Path) -> None:
    """torchrun's --shutdown-timeout: SIGTERM, then this long before SIGKILL (was accepted and ignored: SIGKILL
    came after --grace, and a rank saving on SIGTERM was cut off)."""
    code, err, elapsed, pids = _start_and_signal(work, signal.SIGTERM, SAVE_ON_SIGTERM,
                                                 ("--grace", "0.3", "--shutdown-timeout", "10"))
    assert code == 143, err
    assert (work / "out" / "saved0").exists() and (work / "out" / "saved1").exists(), err
    assert 1.4 < elapsed < 8, elapsed
    assert not _wait_dead(pids, timeout=1.0)


def test_sigkill_of_the_launcher_leaves_nothing_running(work: Path) -> None:
    """Not even the ranks' children: PDEATHSIG ends the ranks, the launcher's watchdog their process groups.

    (torchrun leaves its ranks running after a SIGKILL.)  Before the watchdog, the ranks' ``sleep 60``
    children ran on."""
    code, err, _, pids = _start_and_signal(work, signal.SIGKILL)
    assert code == -signal.SIGKILL, err
    assert len(pids) == 4
    assert not _wait_dead(pids, timeout=2.0), "orphans left behind"


# ---------------------------------------------------------------- two launchers on this host


@pytest.mark.parametrize("style", ["static", "c10d"])
def test_two_launchers_as_two_nodes(work: Path, style: str) -> None:
    """torchtitan / Megatron style multi-node command lines, two launchers on this host: every rank sees the
    world torchrun gives it (global ranks contiguous per node), and gloo through env:// gets that world."""
    port = _free_port()
    common = ["--nnodes=2", "--nproc-per-node=2"]
    if style == "static":
        per_node = [[*common, f"--node-rank={i}", "--master-addr=127.0.0.1", f"--master-port={port}"] for i in (0, 1)]
    else:  # --node-rank is given, as scripts do, and ignored with a note (the rendezvous assigns it, as torchrun's)
        per_node = [[*common, f"--node_rank={i}", "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}",
                     "--rdzv_id=job", "--max_restarts=0"] for i in (0, 1)]
    # gloo in the ranks for the static pair only: test_launch.py's c10d test runs gloo through the rendezvous
    env = _env(work, {"PROBE_DIST": "1" if style == "static" else "0", "PIPELOOM_JOB_SECRET": "ab" * 16})
    procs = [subprocess.Popen([*LAUNCH, *args, "probe.py", "--steps", "1"], cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in per_node]
    try:
        results = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    errs = [err for _, err in results]
    assert [p.returncode for p in procs] == [0, 0], errs
    if style == "c10d":
        assert all("note: --node-rank is ignored with --rdzv-backend c10d" in err for err in errs), errs
    ranks = {int(Path(f).stem[4:]): json.loads(Path(f).read_text()) for f in glob.glob(str(work / "out" / "rank*.json"))}
    assert sorted(ranks) == [0, 1, 2, 3], errs
    for rank, rec in ranks.items():
        node, local = divmod(rank, 2)
        assert (rec["GROUP_RANK"], rec["LOCAL_RANK"], rec["ROLE_RANK"]) == (str(node), str(local), str(rank)), rec
        assert (rec["WORLD_SIZE"], rec["LOCAL_WORLD_SIZE"], rec["GROUP_WORLD_SIZE"], rec["ROLE_WORLD_SIZE"]) == ("4", "2", "2", "4")
        assert rec["TORCHELASTIC_RUN_ID"] == ("job" if style == "c10d" else "none")
        assert rec.get("dist", [rank, 4, 4.0]) == [rank, 4, 4.0] and rec["argv"] == ["probe.py", "--steps", "1"], rec
    assert len({rec["MASTER_PORT"] for rec in ranks.values()}) == 1


# ---------------------------------------------------------------- ports


def test_free_port_is_outside_the_ephemeral_range() -> None:
    """The master port the launcher picks (one node; node 0 of a rendezvous) is handed to rank 0, which binds it
    seconds later: from the ephemeral range, an outgoing connection of any process could take it meanwhile
    (rank 0's TCPStore failed with EADDRINUSE once in test_launch.py's c10d test beside other jobs)."""
    from pipeloom.tools.rendezvous import _ephemeral_ports, free_port

    lo, hi = _ephemeral_ports()
    for _ in range(100):
        port = free_port()
        assert not lo <= port <= hi and not 29400 <= port < 29600 and 1024 < port < 65536, port
        with socket.socket() as s:
            s.bind(("", port))


# ---------------------------------------------------------------- side by side with real torchrun
#
# Each test below runs real torchrun (``python -m torch.distributed.run``, about two seconds) and ``pipeloom
# launch`` on the same command line and asserts what both do.  Each failed before the fix it names.

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
BOTH = {"torchrun": TORCHRUN, "pipeloom": LAUNCH}


@dataclass
class Ran:
    code: int
    err: str
    ranks: dict[int, dict[str, Any]]
    out: Path
    stdout: str = ""


def _run_both(work: Path, args: list[str], extra: dict[str, str] | None = None, timeout: float = 60.0,
              preexec: Any = None) -> dict[str, Ran]:
    """Run the command line under both launchers, each with its own PROBE_OUT; {launcher: what it did}."""
    port = str(_free_port())
    args = [a.replace("{PORT}", port).replace("{DIR}", str(work)) for a in args]
    got = {}
    for name, cmd in BOTH.items():
        out = work / "out" / name
        out.mkdir()
        env = _env(work, {k: v.replace("{DIR}", str(work)).replace("{L}", name) for k, v in (extra or {}).items()})
        env["PROBE_OUT"] = str(out)
        proc = subprocess.run([*cmd, *args], cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=preexec)
        ranks = {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
        got[name] = Ran(proc.returncode, proc.stderr, ranks, out, proc.stdout)
    return got


# What may differ in a rank's environment between the two, and why (README, "What still differs from torchrun").
ENV_LEGITIMATELY_DIFFERENT = {
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "PROBE_OUT",  # per run
    "MASTER_ADDR",  # 127.0.0.1 here, localhost under torchrun's c10d (documented)
    "TORCHELASTIC_USE_AGENT_STORE",  # no agent store: rank 0 creates it, as with env:// (documented)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",  # torch's default left in place: the runtime aborts its communicators (documented)
}


def test_worker_environment_matches_torchrun(work: Path) -> None:
    """Every variable a rank sees under torchrun it sees here with the same value, but for the documented few
    (``TORCHELASTIC_SIGNALS_TO_HANDLE``, which torchrun's agent exports, was missing), plus pipeloom's own."""
    got = _run_both(work, ["--nproc-per-node=2", "--max-restarts=1", "--role", "trainer", "probe.py"])
    for name, ran in got.items():
        assert ran.code == 0 and sorted(ran.ranks) == [0, 1], (name, ran.err)
    for rank in (0, 1):
        tr, pl = got["torchrun"].ranks[rank]["environ"], got["pipeloom"].ranks[rank]["environ"]
        missing = {k: tr[k] for k in tr if k not in pl and k not in ENV_LEGITIMATELY_DIFFERENT}
        assert not missing, f"rank {rank}: torchrun sets these, pipeloom does not: {missing}"
        wrong = {k: (tr[k], pl[k]) for k in tr if k in pl and tr[k] != pl[k] and k not in ENV_LEGITIMATELY_DIFFERENT}
        assert not wrong, f"rank {rank}: (torchrun, pipeloom): {wrong}"
        extra = {k for k in pl if k not in tr and not k.startswith("PIPELOOM_")}
        assert not extra, f"rank {rank}: pipeloom sets these, torchrun does not: {extra}"
    assert got["pipeloom"].ranks[0]["environ"]["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


@pytest.mark.parametrize("case", ["nnodes-range", "master-port-and-node-rank"])
def test_standalone_overrides_like_torchrun(work: Path, case: str) -> None:
    """``--standalone --nnodes 1:2`` ran under torchrun (one node, after last_call_timeout) and was refused here
    (exit 2); ``--standalone`` with ``--node-rank 1`` was refused, and its ``--master-port`` was used (torchrun
    takes a free port: a busy port, two jobs on one host copying a script's 29500, failed here only)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        flags = (["--nnodes", "1:2", "--rdzv-conf", "last_call_timeout=1"] if case == "nnodes-range" else
                 ["--node-rank", "1", "--master-port", str(port)])
        # gloo through env:// where the store's port matters (the busy one)
        dist = {"PROBE_DIST": "1"} if case == "master-port-and-node-rank" else {}
        got = _run_both(work, ["--standalone", *flags, "--nproc-per-node=2", "probe.py"], dist)
    for name, ran in got.items():
        assert ran.code == 0, (name, ran.err)
        assert sorted(ran.ranks) == [0, 1], (name, ran.err)
        for rank, rec in ran.ranks.items():
            assert (rec["GROUP_RANK"], rec["GROUP_WORLD_SIZE"], rec["WORLD_SIZE"]) == ("0", "1", "2"), (name, rec)
            assert rec.get("dist", [rank, 2, 2.0]) == [rank, 2, 2.0] and rec["MASTER_PORT"] != str(port), (name, rec)
    assert "note: --standalone" in got["pipeloom"].err


def test_standalone_needing_several_nodes_is_refused(work: Path) -> None:
    """Deliberate: ``--standalone --nnodes 2`` waits under torchrun for a node that cannot find its localhost:0
    rendezvous until join_timeout (600 s), then fails; pipeloom refuses it at once (exit 2)."""
    code, _, err, ranks = _launch(work, ["--standalone", "--nnodes", "2", "--nproc-per-node=2", "probe.py"], {})
    assert code == 2 and not ranks and "--standalone is a single-node job, but --nnodes 2 needs 2 nodes" in err, err


def test_abbreviated_flags_as_torchrun(work: Path) -> None:
    """torchrun's parser takes unambiguous prefixes (``--redirect 3``, as its own help text writes it); pipeloom
    said 'unrecognized arguments' (exit 2)."""
    got = _run_both(work, ["--redirect", "3", "--log_dir", "{DIR}/logs-{L}", "--nproc_per", "2", "probe.py"], {})
    for name, ran in got.items():
        assert ran.code == 0 and sorted(ran.ranks) == [0, 1], (name, ran.err)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_nproc_cpu_counts_the_cpus_the_launcher_may_use(work: Path) -> None:
    """``--nproc-per-node cpu`` under ``taskset -c 0`` (a cgroup, a SLURM step's CPUs): torchrun starts one rank
    per CPU it may use (torch._utils.cpu_count); pipeloom started one per CPU of the machine."""
    cpu = min(os.sched_getaffinity(0))
    got = _run_both(work, ["--nproc-per-node", "cpu", "probe.py"], preexec=lambda: os.sched_setaffinity(0, {cpu}))
    for name, ran in got.items():
        assert ran.code == 0 and sorted(ran.ranks) == [0], (name, ran.err)


def test_log_line_prefix_template_as_torchrun(work: Path) -> None:
    """torchrun's ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` prefixes the echoed lines (here with ``--tee 3``, where
    torchrun echoes them); pipeloom ignored it and wrote ``[rank{R}]: ``."""
    got = _run_both(work, ["--nproc-per-node=2", "--tee", "3", "--log-dir", "{DIR}/logs-{L}", "--role", "w", "probe.py"],
                    {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${role_name}|${rank}|${local_rank}> "})
    for name, ran in got.items():
        assert ran.code == 0 and sorted(ran.ranks) == [0, 1], (name, ran.err)
        assert sorted(ran.stdout.splitlines()) == ["<w|0|0> probe of rank 0", "<w|1|1> probe of rank 1"], (name, ran.stdout)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")
def test_ipv6_master_addr_in_brackets(work: Path) -> None:
    """``--master-addr [::1]``, the IPv6 form torchrun's help asks for: torchrun's ranks see ``MASTER_ADDR=::1`` and
    meet; pipeloom handed them ``[::1]`` and rank 1 timed out connecting to the store."""
    got = _run_both(work, ["--nproc-per-node=2", "--master-addr", "[::1]", "--master-port", "{PORT}", "probe.py"],
                    {"PROBE_DIST": "1"})
    for name, ran in got.items():
        assert ran.code == 0 and sorted(ran.ranks) == [0, 1], (name, ran.err)
        for rank, rec in ran.ranks.items():
            assert rec["MASTER_ADDR"] == "::1" and rec["dist"] == [rank, 2, 2.0], (name, rec)


RECORD_SCRIPT = textwrap.dedent(
    """\
    import os
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        if os.environ.get("RECORD_RAISE") == "1":
            raise ValueError("boom in rank " + os.environ["RANK"])

    main()
    """
)


@pytest.mark.parametrize("recorded", [True, False])
def test_launchers_error_file_gets_the_root_cause(work: Path, recorded: bool) -> None:
    """A launcher started with ``TORCHELASTIC_ERROR_FILE`` (TorchX does, to learn why a job failed): torchrun's
    ``@record`` copies the root-cause rank's error file there with its exit code as ``errorCode``; pipeloom wrote
    nothing.  A rank without ``@record`` writes no error file, and neither launcher writes one then."""
    (work / "rec.py").write_text(RECORD_SCRIPT if recorded else 'raise ValueError("boom, no @record")\n')
    got = _run_both(work, ["--nproc-per-node=1", "rec.py"],
                    {"RECORD_RAISE": "1", "TORCHELASTIC_ERROR_FILE": "{DIR}/launcher-error-{L}.json"})
    files = {name: work / f"launcher-error-{name}.json" for name in BOTH}
    for name, ran in got.items():
        assert ran.code == 1, (name, ran.err)
        assert files[name].exists() == recorded, name
    if recorded:
        tr, pl = (json.loads(files[name].read_text())["message"] for name in BOTH)
        assert pl["message"] == tr["message"] == "ValueError: boom in rank 0"
        assert pl["errorCode"] == tr["errorCode"] == 1
        assert pl["extraInfo"]["py_callstack"] == tr["extraInfo"]["py_callstack"]


SIGNALLED_SCRIPT = textwrap.dedent(
    """\
    import os, signal, sys, time
    d, r = os.environ["PROBE_OUT"], os.environ["RANK"]

    def on_signal(signum, frame):  # e.g. a checkpoint before SLURM's time limit, or on preemption: it takes a while
        time.sleep(float(os.environ.get("SAVE_SECONDS", "0")))
        open(os.path.join(d, f"got{r}"), "w").write(signal.Signals(signum).name)
        sys.exit(0)

    for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    open(os.path.join(d, f"pid{r}"), "w").write(str(os.getpid()))
    time.sleep(60)
    """
)


def _signal_both(work: Path, args: list[str], sig: int, extra: dict[str, str] | None = None) -> dict[str, Ran]:
    """Start the script under each launcher, send the launcher ``sig`` once every rank runs, wait for its exit."""
    (work / "sig.py").write_text(SIGNALLED_SCRIPT)
    got = {}
    for name, cmd in BOTH.items():
        out = work / "out" / name
        out.mkdir()
        env = _env(work, extra or {})
        env["PROBE_OUT"] = str(out)
        proc = subprocess.Popen([*cmd, *args, "sig.py"], cwd=work, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            end = time.monotonic() + 30
            while len(list(out.glob("pid*"))) < 2:
                assert time.monotonic() < end and proc.poll() is None, (name, "ranks did not start")
                time.sleep(0.02)
            time.sleep(0.3)  # inside their sleep, handlers installed
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for f in out.glob("pid*"):
                try:
                    os.kill(int(f.read_text()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        got[name] = Ran(proc.returncode, err, {}, out)
    return got


def _received(ran: Ran) -> list[str]:
    return [(ran.out / f"got{r}").read_text() if (ran.out / f"got{r}").exists() else "" for r in (0, 1)]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2])
def test_signals_to_handle_forwards_the_signal(work: Path, sig: int) -> None:
    """``--signals-to-handle SIGTERM,SIGINT,SIGUSR1`` (SLURM's ``--signal=USR1@90`` before the time limit): torchrun
    forwards the SIGUSR1 to every rank, whose handler saves and exits; pipeloom ignored the flag and died of the
    signal, the ranks killed with it (PDEATHSIG) before any handler ran.  The exit status differs by design
    (torchrun 1, pipeloom 128 + the signal)."""
    name = signal.Signals(sig).name
    got = _signal_both(work, ["--nproc-per-node=2", f"--signals-to-handle=SIGTERM,SIGINT,{name}"], sig)
    for launcher, ran in got.items():
        assert _received(ran) == [name, name], (launcher, ran.err)
    assert got["torchrun"].code == 1 and got["pipeloom"].code == 128 + sig, got["pipeloom"].err
    assert f"pipeloom launch: stopped by {name}" in got["pipeloom"].err


def test_torch_elastic_shutdown_timeout_gives_the_ranks_time(work: Path) -> None:
    """``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` is torchrun's default for ``--shutdown-timeout``: a rank that takes 2.5 s
    to save on SIGTERM gets them under both (pipeloom ignored it: SIGKILL came after --grace, 2 s)."""
    got = _signal_both(work, ["--nproc-per-node=2"], signal.SIGTERM,
                       {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "10", "SAVE_SECONDS": "2.5"})
    for launcher, ran in got.items():
        assert _received(ran) == ["SIGTERM", "SIGTERM"], (launcher, ran.err)


BUILD_FAILS_FIRST = textwrap.dedent("""\
    import json, os, sys, time, torch, pipeloom
    from torch import nn
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])

    def stage(s):
        if attempt == 0 and s == 1:
            raise ValueError("stage 1 cannot be built in the first attempt")
        if attempt == 1 and s == 1:
            time.sleep(1.5)  # rank 0 reaches the agreement on the built stages first
        return nn.Linear(4, 4)

    pipe = pipeloom.Pipeline(stage, schedule="1F1B", num_microbatches=2, loss_fn=nn.functional.mse_loss)
    pipe.step(torch.randn(4, 4), target=torch.randn(4, 4), return_outputs=False)
    # (one write: the ranks share torchrun's stdout, and print's separate writes of "RESULT" and the record
    # interleaved between the two ranks: "RESULTRESULT  {...}{...}")
    sys.stdout.write("RESULT " + json.dumps({"rank": rank, "attempt": attempt, "loss": pipe.last_loss()}) + "\\n")
    sys.stdout.flush()
    pipe.close()
""")


@pytest.mark.parametrize("launcher", sorted(BOTH))
def test_a_restart_after_a_failed_construction_does_not_read_the_failed_attempts_records(work: Path, launcher: str) -> None:
    """torchrun's agent serves the store, and it outlives an attempt.  The construction's agreement (each rank's
    record of the Pipeline it builds, read by its peers through the store) used the store without torchrun's
    per-attempt prefix: after a first attempt where rank 1 failed to build its stage, the restarted rank 0 read
    that attempt's record ("stage 1 cannot be built") and failed again, and so did the job."""
    (work / "job.py").write_text(BUILD_FAILS_FIRST)
    port = str(_free_port())
    proc = subprocess.run([*BOTH[launcher], "--nproc-per-node=2", "--max-restarts=1", "--master-port", port, "job.py"],
                          cwd=work, env=_env(work, {}), capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT {" in line]
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["attempt"] == 1 for r in results), proc.stdout
    assert results[0]["loss"] == results[1]["loss"], results
