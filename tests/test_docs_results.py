"""Every RESULT line the README or docs/ quote comes from a bench that still prints it: each quoted key (and each
`bench=` name) is in the bench sources. A bench that drops or renames a key fails this until the page follows."""
from __future__ import annotations

import re

from tests.helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `RESULT key=value ...`: the quoted keys, a quote running over a line break included.
QUOTE = re.compile(r"RESULT\s+((?:[A-Za-z_][\w.]*=[^\s`]*\s+)*[A-Za-z_][\w.]*=[^\s`]*)")
PLACEHOLDERS = {"key"}  # `RESULT key=value ...`: how a RESULT line reads, no bench's


def quoted_results(text: str) -> list[dict[str, str]]:
    flat = re.sub(r"\s+", " ", text)
    return [dict(pair.split("=", 1) for pair in m.group(1).split()) for m in QUOTE.finditer(flat)]


def bench_sources() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "app" / "bench").rglob("*.py")))


def missing_keys(results: list[dict[str, str]], sources: str) -> list[str]:
    words = set(re.findall(r"[A-Za-z_]\w*", sources))
    out = []
    for fields in results:
        for key, value in fields.items():
            if key not in PLACEHOLDERS and key not in words:
                out.append(key)
            if key == "bench" and value not in words:
                out.append(f"bench={value}")
    return out


def test_the_quote_finder_reads_keys_over_a_line_break_and_skips_the_placeholder():
    text = "a `RESULT side=drafters repeats=1\noff_jobs_per_vs=1.500` and `RESULT key=value ...`"
    assert quoted_results(text) == [{"side": "drafters", "repeats": "1", "off_jobs_per_vs": "1.500"}, {"key": "value"}]
    assert missing_keys(quoted_results(text), "print_result(side=s, repeats=r, off_jobs_per_vs=x)") == []
    assert missing_keys(quoted_results(text), "print_result(side=s, repeats=r)") == ["off_jobs_per_vs"]
    assert missing_keys([{"bench": "gone"}], "bench = 'quality_smol'") == ["bench=gone"]


def test_every_quoted_result_key_is_printed_by_a_bench():
    sources = bench_sources()
    found = {p.name: quoted_results(p.read_text()) for p in PAGES}
    assert sum(len(r) for r in found.values()) >= 10  # the pages do quote bench lines
    missing = {name: missing_keys(results, sources) for name, results in found.items()}
    assert {k: v for k, v in missing.items() if v} == {}
