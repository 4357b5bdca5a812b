"""Stacks of a rank process that hangs or crashes, for a GPU session (``gpu_run.sh recheck`` puts this directory
first on ``PYTHONPATH``): with ``PL_DUMP_DIR`` set, each process started with a ``RANK`` writes its Python stacks
to ``PL_DUMP_DIR/stack-<PL_TAG>-r<RANK>-<pid>.txt`` on a fatal signal (SIGSEGV, SIGABRT...) and after
``PL_DUMP_AFTER`` seconds (default 40) if still running.  (Session W found its two NCCL hangs and a segfault so:
the test harness's own SIGUSR1 dump needs the job script's cooperation, and ranks forked from its zygote never run
this file: set ``PIPELOOM_TEST_FORK=0``.)"""
import faulthandler
import os

_d = os.environ.get("PL_DUMP_DIR")
if _d and os.environ.get("RANK") is not None:
    _f = open(os.path.join(_d, f"stack-{os.environ.get('PL_TAG', 'x')}-r{os.environ['RANK']}-{os.getpid()}.txt"), "w")
    faulthandler.enable(file=_f)
    faulthandler.dump_traceback_later(float(os.environ.get("PL_DUMP_AFTER", "40")), file=_f)
