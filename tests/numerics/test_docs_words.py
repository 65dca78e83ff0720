"""The shipped text names versions, commits, dates and machines, never the process that made it: no numbered
rounds or sessions, no tracker issue numbers, no round named relative to now, no record of which round had a
machine on loan. A reader can act on "0.2.0 (unreleased)" or "measured at commit d84b643 on 2026-11-27 on the 2-core
Intel Xeon"; not on a round number or an item of a tracker issue they cannot see.

Scanned: README.md, CHANGELOG.md, docs/**/*.md, rope_quant/**/*.py, tests/**/*.py, pyproject.toml, tox.ini and
.ci/*, this module included. The patterns spell their spaces as ``\\s+`` and the self-test builds its offending
samples by concatenation, so this module holds none of the phrases it forbids."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Each pattern names one kind of process talk. Case-insensitive. Legitimate words they must leave alone are in
#: ``test_the_phrase_checker_leaves_legitimate_words_alone``.
PATTERNS: dict[str, str] = {
    # the word followed by a number, with or without "#" or "-" (a URL's /issues/123 is not prose)
    "numbered issue": r"(?<![/\w])issues?[\s#-]*\d+",
    # a definite reference to a tracker item ("the" + the word), or the word alone in parentheses; not an
    # upstream thread ("the" + the word + "thread")
    "definite issue": r"\bthe\s+issue\b(?!\s+(?:thread|tracker))|\(issues?\s*[):]",
    # a tracker issue named by its topic (verdicts, GPU, paper scale, performance)
    "named issue": r"\bthe\s+(?:verdict|gpu|paper[-\s]scale|performance|project's(?:\s+gpu)?)\s+issue\b",
    # a numbered round or session; not a ``--rounds N`` option or ``rounds=N``
    "numbered round": r"(?<![-\w])(?:rounds?|sessions?)\s+\d+",
    # a round or session named relative to now; not pytest's session ("the session's model", "session-scoped")
    "relative round": r"\b(?:this|that|last|next|previous|earlier|later|prior)\s+(?:round|session)\b"
    r"|\bthe\s+(?:round|session)\s+(?:that|which|before|after)\b|\b(?:round|session)s?\s+of\s+work\b",
    # which round a machine was (or was not) on loan to
    "machine on loan": r"\blent\b",
}
_COMPILED = {name: re.compile(p, re.I) for name, p in PATTERNS.items()}


def _files() -> list[Path]:
    found = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "pyproject.toml", REPO / "tox.ini"]
    found += sorted((REPO / "docs").rglob("*.md"))
    found += sorted((REPO / "rope_quant").rglob("*.py"))
    found += sorted((REPO / "tests").rglob("*.py"))
    found += sorted(p for p in (REPO / ".ci").glob("*") if p.is_file())
    return [p for p in found if p.is_file()]


def offences(text: str) -> list[tuple[int, str, str]]:
    """(line number, pattern name, matched phrase) for every piece of process talk in ``text``."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for name, rx in _COMPILED.items():
            out += [(lineno, name, m.group(0)) for m in rx.finditer(line)]
    return out


def _report(paths: list[Path]) -> list[str]:
    return [f"{p.relative_to(REPO).as_posix()}:{n}: {name}: {phrase!r}"
            for p in paths for n, name, phrase in offences(p.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("part", ["README.md", "CHANGELOG.md", "docs", "rope_quant", "tests", "config"])
def test_no_process_talk(part):
    """Reword each hit to name a version, commit, date or machine (see the module docstring)."""
    files = _files()
    chosen = {
        "README.md": [REPO / "README.md"], "CHANGELOG.md": [REPO / "CHANGELOG.md"],
        "docs": [p for p in files if p.is_relative_to(REPO / "docs")],
        "rope_quant": [p for p in files if p.is_relative_to(REPO / "rope_quant")],
        "tests": [p for p in files if p.is_relative_to(REPO / "tests")],
        "config": [REPO / "pyproject.toml", REPO / "tox.ini", *(p for p in files if p.is_relative_to(REPO / ".ci"))],
    }[part]
    hits = _report([p for p in chosen if p.is_file()])
    assert not hits, f"{len(hits)} phrase(s) about the process, not the product:\n" + "\n".join(hits)


def test_the_phrase_checker_finds_process_talk():
    i, s, r = "issue", "session", "round"  # joined below, so this file holds none of the phrases it forbids
    bad = [f"({i} 22, item 8)", f"{i.title()} 24's goal", f"{i}s 21 and 23", f"{i} #5", f"the {i}-31 H100",
           f"the {i}'s CPU targets", f"1.42x ({i})", f"({i}: can it close the gap?)", f"the verdict {i}",
           f"the GPU {i}'s target", f"the paper-scale {i}", f"{s.title()} 12, verdicts", f"{s}s 9-10",
           f"since {s} 11", f"{r} 3", f"this {r}", f"the previous {s}'s run", f"the {s} that wrote it",
           f"no GPU was {'le' + 'nt'} to it", f"the last {s}"]
    missed = [b for b in bad if not offences(b)]
    assert not missed, f"not caught: {missed}"


def test_the_phrase_checker_leaves_legitimate_words_alone():
    i = "issue"  # joined below, so this file holds none of the phrases the project's stop hook greps for
    good = ["round-to-nearest (RTN)", "rounds half to even", "a round trip", "--rounds 3", "rounds=3",
            "best of 3 rounds", "for _ in range(rounds)", "the session-scoped fixture", "the session's model",
            "at the end of the session", "per session, in config.stash", f"see the GitHub {i} thread upstream",
            "the CLI issues a DeprecationWarning", "ISSUE_ROTATE_S", "github.com/o/r/issues/123",
            "0.2.0 (unreleased)", "measured at commit d84b643 on 2026-11-27 on the 2-core Intel Xeon",
            "not yet measured on a GPU", "silently", "the rounded zero point", "a scale that rounds past"]
    flagged = [(g, offences(g)) for g in good if offences(g)]
    assert not flagged, f"false positives: {flagged}"
