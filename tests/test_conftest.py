"""The suite's own time limit (tests/conftest.py), run in a pytest of its own."""
import os

pytest_plugins = ["pytester"]


def test_a_hung_test_fails_and_stops_the_run(pytester, monkeypatch):
    """The test past the limit fails with a traceback into the hang, even one that swallows every
    Exception; the run stops there with its report and exit status 1."""
    pytester.makeconftest(open(os.path.join(os.path.dirname(__file__), "conftest.py")).read())
    pytester.makepyfile(test_hang="""
        import time

        def test_before():
            pass

        def test_hangs():
            while True:
                try:
                    time.sleep(0.05)
                except Exception:
                    pass

        def test_after():
            pass
    """)
    monkeypatch.setenv("DFLASH_TEST_TIMEOUT_S", "1.5")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=120)  # a swallowed limit hangs
    out = result.stdout.str()
    assert result.ret == 1 and "1 failed, 1 passed" in out, out
    assert "test_hang.py:9: " in out and "this test ran past 1.5 s" in out  # the line it hung on (the sleep)
    assert "stopped: test_hang.py::test_hangs ran past 1.5 s" in out, out
