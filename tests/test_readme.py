"""
The README's file list names files that exist (its drafter-of-your-own example is run by
tests/test_speculate.py::test_the_readme_drafter_of_your_own_runs_and_is_lossless).

    python -m pytest -q tests/test_readme.py
"""

import os

from data import ROOT

README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def test_every_file_the_readme_lists_exists():
    listing = README[README.index("## Files"):]
    listing = listing[listing.index("```\n") + 4:]
    listing = listing[:listing.index("\n```")]
    names = [line.split()[0] for line in listing.splitlines()]
    assert len(names) > 15
    missing = [n for n in names if not os.path.exists(os.path.join(ROOT, n))]
    assert not missing, missing
