"""An instruction prompt set built on the machine, from text every Python install has.

Sources: the standard library's modules, read with `ast` (never imported, so nothing in them runs): each
module's docstring and its public functions' signatures and docstrings; and the language reference topics of
`pydoc_data.topics` (a dict of text). Each source is turned into instructions of five kinds:

  explain    explain what a function does (from its name and signature)
  summarise  summarise a passage (a reference topic or a module docstring)
  code       write a short program that uses a function
  list       list what a module is for / the points of a passage
  question   answer a question about a passage (a function's docstring)

Train and eval prompts come from disjoint sources: a source (a module, a reference topic) is held out for eval
when its name's sha256 falls in the held-out share, so no eval prompt is about a module or topic a training
prompt saw. The set is deterministic for a seed (and one interpreter's stdlib). Records are user-only
`{"messages": [{"role": "user", ...}]}` lines (plus `kind` and `source`, which readers ignore).

The files are written by `python -m app.instructions` (app/instructions.py); benches build the set in memory
(`build_instructions`).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

KINDS = ("explain", "summarise", "code", "list", "question")
HELD_OUT_PERCENT = 15  # share of sources (by name hash) whose prompts are eval-only
PASSAGE_CHARS = 700  # passages are cut at a paragraph or sentence end below this (~175 tokens)
MAX_SIGNATURE_CHARS = 80  # longer argument lists are shown as (...)
MIN_DOC_CHARS = 80  # shorter docstrings say too little to summarise or question
# Folders of the stdlib that are tests, tools, data or platform shells rather than library modules.
_SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "ensurepip", "lib2to3",
              "pydoc_data", "encodings", "__pycache__", "tkinter", "__phello__", "venv"}
_MAX_SOURCE_CHARS = 400_000  # a module larger than this is data (unicode tables), not prose


@dataclass(frozen=True)
class Instruction:
    """One prompt: its kind, the source it came from (a module or `topic:<key>`) and the user text."""

    kind: str
    source: str
    text: str

    def record(self) -> dict:
        """The JSONL record the data readers accept (a user turn; `kind` and `source` ride along)."""
        return {"messages": [{"role": "user", "content": self.text}], "kind": self.kind, "source": self.source}


@dataclass(frozen=True)
class _Function:
    module: str
    name: str
    signature: str
    doc: str


@dataclass(frozen=True)
class _Passage:
    source: str  # module name or topic:<key>
    title: str  # what the passage is about, as the prompt names it
    text: str


def split_key(source: str) -> str:
    """What the train/eval split is decided on: a module's top-level package (asyncio.tasks -> asyncio, so a
    package is on one side whole), a reference topic itself."""
    return source if source.startswith("topic:") else source.split(".")[0]


def held_out(source: str) -> bool:
    """Whether a source's prompts are eval-only: a fixed share of split keys by sha256 (independent of the seed
    and of which other modules this interpreter has)."""
    return int(hashlib.sha256(split_key(source).encode()).hexdigest()[:8], 16) % 100 < HELD_OUT_PERCENT


def cut_passage(text: str, limit: int = PASSAGE_CHARS) -> str:
    """The text's leading paragraphs up to `limit` characters; a first paragraph that is longer is cut at its
    last sentence end inside the limit (or at the limit)."""
    paras = [p.strip() for p in text.strip().split("\n\n") if p.strip()]
    out = ""
    for p in paras:
        if len(out) + len(p) + 2 > limit:
            break
        out = f"{out}\n\n{p}" if out else p
    if not out and paras:
        head = paras[0][:limit]
        dot = head.rfind(". ")
        out = head[:dot + 1] if dot > limit // 3 else head
    return out


def _stdlib_files() -> list[tuple[str, Path]]:
    """(dotted module name, file) of the standard library's modules, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_DIRS & set(rel.parts[:-1]) or any(part.startswith("_") for part in rel.with_suffix("").parts):
            continue  # private modules (_pydecimal, __main__, ...) are not what users ask about
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts:
            out.append((".".join(parts), path))
    return sorted(out)


def _module_items(name: str, path: Path) -> tuple[_Passage | None, list[_Function], list[str]]:
    """A module's docstring passage, its public documented functions, and all its public function names."""
    try:
        source = path.read_text(encoding="utf-8")
        if len(source) > _MAX_SOURCE_CHARS:
            return None, [], []
        tree = ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None, [], []  # an unreadable or unparsable file is not a source
    doc = ast.get_docstring(tree) or ""
    passage = _Passage(name, f"the `{name}` module", cut_passage(doc)) if len(doc) >= MIN_DOC_CHARS else None
    funcs, names = [], []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            names.append(node.name)
            fdoc = ast.get_docstring(node) or ""
            if len(fdoc) >= MIN_DOC_CHARS // 2:
                args = ast.unparse(node.args)
                # A long signature (a dozen keywords) would dominate the prompt: name the call only.
                funcs.append(_Function(name, node.name, f"({args})" if len(args) <= MAX_SIGNATURE_CHARS else "(...)",
                                       cut_passage(fdoc)))
    return passage, funcs, names


def _topics() -> list[_Passage]:
    """The language reference topics of pydoc_data (a dict of text: importing it runs nothing else)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    out = []
    for key in sorted(topics):
        text = topics[key]
        lines = text.strip().splitlines()
        title = lines[0].strip() if lines else key
        body = "\n".join(lines[2:]) if len(lines) > 2 and set(lines[1].strip()) <= {"*", "=", "-"} else text
        passage = cut_passage(body)
        if len(passage) >= MIN_DOC_CHARS:
            out.append(_Passage(f"topic:{key}", f'the Python reference section "{title}"', passage))
    return out


# Several phrasings per kind, so the set is not one sentence with blanks.
def _explain(f: _Function, i: int) -> str:
    call = f"{f.module}.{f.name}{f.signature}"
    return [f"Explain what the Python function `{call}` does and when you would use it.",
            f"What does `{f.module}.{f.name}` do in Python? Explain its arguments: `{f.name}{f.signature}`.",
            f"I found `{call}` in some code. Can you explain what it does, in plain words?"][i % 3]


def _code(f: _Function, i: int) -> str:
    return [f"Write a short Python example that uses `{f.module}.{f.name}` and explain what it prints.",
            f"Show me how to call `{f.module}.{f.name}{f.signature}` in a small program, with comments.",
            f"Write a Python function that uses `{f.module}.{f.name}` to solve a small, realistic task."][i % 3]


def _summarise(p: _Passage, i: int) -> str:
    ask = ["Summarise this passage from {t} in two or three sentences.",
           "Give a short summary of the following text from {t}.",
           "Summarize this excerpt from {t} for a beginner."][i % 3].format(t=p.title)
    return f"{ask}\n\n{p.text}"


def _list(p: _Passage, names: list[str], i: int) -> str:
    if names and i % 2 == 0:
        shown = ", ".join(f"`{n}`" for n in names[:8])
        return (f"List the main functions of Python's `{p.source}` module (for example {shown}) and say in one line "
                "what each is for.")
    return f"List the key points of this passage from {p.title} as a bulleted list.\n\n{p.text}"


def _question(f: _Function, i: int) -> str:
    q = [f"What does `{f.name}` return, and when would you use it?",
         f"Which arguments does `{f.name}` take, and what do they control?",
         f"According to the passage, what is `{f.name}` for? Answer in a few sentences."][i % 3]
    return (f"Read this passage from the documentation of `{f.module}.{f.name}` and answer the question.\n\n"
            f"{f.doc}\n\nQuestion: {q}")


@functools.lru_cache(maxsize=1)
def candidates() -> dict[str, tuple[Instruction, ...]]:
    """Every instruction the sources give, per kind, in a fixed order (before sampling). Cached: reading the
    stdlib takes seconds, and the result is the same for the life of the interpreter."""
    out: dict[str, list[Instruction]] = {k: [] for k in KINDS}
    for name, path in _stdlib_files():
        passage, funcs, names = _module_items(name, path)
        for i, f in enumerate(funcs):
            out["explain"].append(Instruction("explain", name, _explain(f, i)))
            out["code"].append(Instruction("code", name, _code(f, i)))
            if len(f.doc) >= MIN_DOC_CHARS:
                out["question"].append(Instruction("question", name, _question(f, i)))
        if passage is not None:
            out["summarise"].append(Instruction("summarise", name, _summarise(passage, len(name))))
            out["list"].append(Instruction("list", name, _list(passage, names, len(name))))
    for i, p in enumerate(_topics()):
        out["summarise"].append(Instruction("summarise", p.source, _summarise(p, i)))
        out["list"].append(Instruction("list", p.source, _list(p, [], i + 1)))
    return {k: tuple(v) for k, v in out.items()}


def sample(pool: dict[str, tuple[Instruction, ...] | list[Instruction]], count: int, rng: random.Random) -> list[Instruction]:
    """`count` instructions, the kinds taking turns (a kind that runs out leaves its turns to the others),
    each kind's pool shuffled and sampled without replacement; within a kind, one source is not repeated
    until every source has had a prompt (so a module with 90 functions does not crowd out the rest)."""
    queues = {}
    for kind, items in pool.items():
        items = list(items)
        rng.shuffle(items)
        seen: set[str] = set()
        first, rest = [], []
        for it in items:  # stable: the shuffled order, sources' first prompts before their seconds
            (rest if it.source in seen else first).append(it)
            seen.add(it.source)
        queues[kind] = first + rest
    out: list[Instruction] = []
    while len(out) < count and any(queues.values()):
        for kind in KINDS:
            if queues.get(kind) and len(out) < count:
                out.append(queues[kind].pop(0))
    if len(out) < count:
        raise ValueError(f"asked for {count} prompts but this Python's standard library gives only {len(out)}; "
                         "ask for fewer")
    return out


def build_instructions(num_train: int = 192, num_eval: int = 32, *, seed: int = 0) -> tuple[list[Instruction],
                                                                                            list[Instruction]]:
    """(train, eval) instructions from disjoint sources, deterministic for the seed (`.text` is the prompt)."""
    if num_train < 1 or num_eval < 0:
        raise ValueError(f"num_train={num_train}, num_eval={num_eval}: need at least 1 training prompt and >= 0 eval")
    pool = candidates()
    train_pool = {k: [it for it in v if not held_out(it.source)] for k, v in pool.items()}
    eval_pool = {k: [it for it in v if held_out(it.source)] for k, v in pool.items()}
    train = sample(train_pool, num_train, random.Random(f"{seed}:train"))
    evals = sample(eval_pool, num_eval, random.Random(f"{seed}:eval"))
    return train, evals
