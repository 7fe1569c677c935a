"""Every RESULT line the README or docs/ quote comes from a bench that still prints it: one module under app/bench/
names every quoted key (and the quoted `bench=` name) in its code, docstrings and comments left out. A bench that
drops or renames a key, a key only a docstring still names, or a line whose keys no one bench prints together
fails this until the page follows. No bench runs: the keys are read off the sources."""
from __future__ import annotations

import ast
import functools
import re

from tests.helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `RESULT key=value ...`: the quoted keys, a quote running over a line break included.
QUOTE = re.compile(r"RESULT\s+((?:[A-Za-z_][\w.]*=[^\s`]*\s+)*[A-Za-z_][\w.]*=[^\s`]*)")
PLACEHOLDERS = {"key"}  # `RESULT key=value ...`: how a RESULT line reads, no bench's
WORD = re.compile(r"[A-Za-z_]\w*")


def quoted_results(text: str) -> list[dict[str, str]]:
    flat = re.sub(r"\s+", " ", text)
    return [dict(pair.split("=", 1) for pair in m.group(1).split()) for m in QUOTE.finditer(flat)]


def code_words(source: str) -> set[str]:
    """The words a module's code holds: names, attributes, keyword and argument names, and the words of its string
    constants (a key built as `("tau_mean", mean)` or `{"ratio": r}`). A string standing alone as a statement
    (a docstring) is prose, not code: a key that only it names is printed by nothing."""
    tree = ast.parse(source)
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    words: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            words.update(WORD.findall(node.value))
        elif isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, (ast.keyword, ast.arg)) and node.arg:
            words.add(node.arg)
    return words


@functools.cache
def bench_modules() -> dict[str, set[str]]:
    """{module path: its code words} for every module under app/bench/."""
    paths = sorted((ROOT / "app" / "bench").rglob("*.py"))
    return {p.relative_to(ROOT).as_posix(): code_words(p.read_text()) for p in paths}


def unprinted(fields: dict[str, str], modules: dict[str, set[str]]) -> list[str]:
    """[] when one bench module names every quoted key (the module naming the quoted `bench=` name, when there is
    one); else `bench=<name>` when no module names it, or the keys the closest module lacks."""
    keys = [k for k in fields if k not in PLACEHOLDERS]
    bench = fields.get("bench")
    candidates = [m for m in modules if bench is None or bench in modules[m]]
    if not keys or not candidates:
        return [f"bench={bench}"] if keys else []
    closest = min(candidates, key=lambda m: (sum(k not in modules[m] for k in keys), m))
    return [k for k in keys if k not in modules[closest]]


def test_the_quote_finder_reads_keys_over_a_line_break_and_skips_the_placeholder():
    text = "a `RESULT side=drafters repeats=1\noff_jobs_per_vs=1.500` and `RESULT key=value ...`"
    assert quoted_results(text) == [{"side": "drafters", "repeats": "1", "off_jobs_per_vs": "1.500"}, {"key": "value"}]
    assert unprinted({"key": "value"}, {"m": set()}) == []


def test_a_key_only_a_docstring_names_is_not_printed():
    source = '"""Ends `RESULT gone=...`."""\ndef main(s):\n    """`RESULT gone=`"""\n    print_result([("side", s)])\n'
    assert {"side", "print_result", "s"} <= code_words(source) and "gone" not in code_words(source)
    assert unprinted({"side": "x", "gone": "1"}, {"m.py": code_words(source)}) == ["gone"]


def test_a_made_up_line_fails_against_the_real_benches():
    modules = bench_modules()
    real = {"bench": "quality_smol", "drafter": "dflash", "tau_mean": "1.335", "tau_pos": "0.27/0.06/0.01"}
    assert unprinted(real, modules) == []
    assert unprinted({**real, "made_up_ratio": "2.0"}, modules) == ["made_up_ratio"]
    assert unprinted({**real, "speedup": "2.0"}, modules) == ["speedup"]  # a key of another quality_smol_* line
    # Each key is printed by some bench, but no one bench prints them together.
    assert unprinted({**real, "greedy_tok_s": "9.5"}, modules) == ["greedy_tok_s"]
    assert unprinted({"bench": "quality_gone", "drafter": "dflash"}, modules) == ["bench=quality_gone"]


def test_every_quoted_result_line_is_printed_by_one_bench():
    modules = bench_modules()
    found = {p.name: quoted_results(p.read_text()) for p in PAGES}
    assert {"README.md", "benchmarks.md", "drafter-quality.md", "troubleshooting.md"} <= set(found)
    assert sum(len(r) for r in found.values()) >= 10  # the pages do quote bench lines
    missing = {name: [(" ".join(fields)[:60], gone) for fields in results if (gone := unprinted(fields, modules))]
               for name, results in found.items()}
    assert {k: v for k, v in missing.items() if v} == {}
