"""Shared pytest setup: the repo root and tests/ on sys.path (so plain `pytest` works as well as
`python -m pytest`), one CPU thread for the tiny test models, a time limit per test, and
run_script, a script's command line run in this process."""
import os
import runpy
import signal
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

# NOTE: the test models are tiny; with several threads on a busy machine every small op pays
# for thread wake-ups (measured: 8 naive generations take 0.8 s on 1 thread, 53 s on 2 threads
# next to a training job). One thread is never slower at this size.
torch.set_num_threads(1)

# A test that hangs (say, a decoding loop whose rows never finish) would hold CI to its
# 90-minute limit and print nothing. The whole suite takes 2-7 minutes on 2 cores, so no
# healthy test comes near the limit: past it the test fails, its traceback showing where it
# was stuck, and the run stops there with its report (one hang usually means many).
# SIGALRM is POSIX only; elsewhere there is no limit.
TEST_TIMEOUT_S = float(os.environ.get("DFLASH_TEST_TIMEOUT_S", 600))
hung = []  # the test that hung, once one has


class Hung(BaseException):
    """Not an Exception, so that code which carries on past a failed step (bench's training
    plan does) cannot swallow it."""


@pytest.fixture(autouse=True)
def fail_a_hung_test(request):
    if hung:
        pytest.exit(f"stopped: {hung[0]} ran past {TEST_TIMEOUT_S:g} s (its failure is above)", returncode=1)
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def time_is_up(signum, frame):
        hung.append(request.node.nodeid)
        raise Hung(f"this test ran past {TEST_TIMEOUT_S:g} s: it hangs, or this machine is far slower than "
                   "any the suite was timed on (then raise DFLASH_TEST_TIMEOUT_S)")
    previous = signal.signal(signal.SIGALRM, time_is_up)
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def run_script(monkeypatch, capsys):
    """run(script, *argv, cwd=None) runs `python script argv...` (its __main__ block) in this
    process, for the cases that must end in one line -> (exit status, stdout, stderr) as the
    interpreter would give them. No interpreter start and torch import per case (2-4 s each on
    2 cores); the random state and thread count are restored. It must end in SystemExit: any
    other exception escaping is what a traceback would have been, and fails the test as itself."""
    def run(script, *argv, cwd=None):
        if cwd is not None:
            monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", [script, *argv])
        threads = torch.get_num_threads()
        try:
            with torch.random.fork_rng(devices=[]), pytest.raises(SystemExit) as e:
                runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
        finally:
            torch.set_num_threads(threads)
        out, code = capsys.readouterr(), e.value.code
        if isinstance(code, str):  # SystemExit("error: ..."): the message to stderr, status 1
            return 1, out.out, out.err + code + "\n"
        return code or 0, out.out, out.err
    return run
