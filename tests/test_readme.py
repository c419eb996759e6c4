"""
The README's file list names files that exist (its drafter-of-your-own example is run by
tests/test_speculate.py::test_the_readme_drafter_of_your_own_runs_and_is_lossless), and the
lab notes' contents link each of their sections.

    python -m pytest -q tests/test_readme.py
"""

import os
import re

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


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_lab_notes_contents_link_every_section_once():
    """docs/experiments.md is long and grows at its end: its contents, grouped by subject, must
    name each section (a new one too) and link nothing that is not there."""
    notes = open(os.path.join(ROOT, "docs", "experiments.md"), encoding="utf-8").read()
    sections = [slug(line[3:]) for line in notes.splitlines() if line.startswith("## ")]
    start = notes.index("## Contents\n")
    linked = re.findall(r"\]\(#([^)]+)\)", notes[start:notes.index("\n## ", start)])
    assert len(sections) > 40 and "contents" in sections
    missing = [s for s in sections if s != "contents" and s not in linked]
    assert not missing, f"add to the contents of docs/experiments.md: {missing}"
    assert sorted(linked) == sorted(set(linked)) == sorted(s for s in sections if s != "contents")
