"""
The README's promises that code can check: its drafter-of-your-own example runs as printed and
prints the tau the README says, and the files it lists exist.

    python -m pytest -q tests/test_readme.py
"""

import os
import re
import subprocess
import sys

from data import ROOT

README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def test_the_write_a_drafter_example_runs_and_prints_what_the_readme_says(tmp_path):
    section = README[README.index("## Write a drafter of your own"):]
    code = section[section.index("```python\n") + 10:]
    code = code[:code.index("\n```")]
    promised = re.search(r"prints `(greedy tau [0-9.]+)`", section).group(1)
    (tmp_path / "mine.py").write_text(code)
    out = subprocess.run([sys.executable, str(tmp_path / "mine.py")], cwd=ROOT, text=True,
                         capture_output=True, timeout=600, env={**os.environ,
                                                                "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.strip().splitlines()[-1] == promised


def test_every_file_the_readme_lists_exists():
    listing = README[README.index("## Files"):]
    listing = listing[listing.index("```\n") + 4:]
    listing = listing[:listing.index("\n```")]
    names = [line.split()[0] for line in listing.splitlines()]
    assert len(names) > 15
    missing = [n for n in names if not os.path.exists(os.path.join(ROOT, n))]
    assert not missing, missing
