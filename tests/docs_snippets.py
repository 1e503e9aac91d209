"""The code blocks of the README and ``docs/*.md``, and how each is checked, so that none can rot.

A block is checked as much as this machine allows, by what its fence and the HTML comment on the line
before it say (``<!-- snippet: ... -->``, invisible on the rendered page):

- ``python`` and ``sh`` blocks run, in order, in a fresh copy of the repository after the README's own
  commands (``tests/test_readme.py``): they use the files the quickstart writes;
- ``yaml`` blocks are validated as configs (a fragment on top of a minimal config);
- ``<!-- snippet: needs WHAT -->``: a block that needs what CI cannot have (a cloud bucket, Dataflow, a
  SLURM or Kubernetes cluster, Airflow). Each ``jacobeam`` command in it is parsed by jacobeam's own
  command line (its Beam options too, and its ``--set`` overrides), and a Python block is compiled and its
  ``jacobeam`` imports resolved. What runs it instead (moto, fake servers, Dask on 127.0.0.1) is in the
  tests named by the comment, where there are any;
- ``<!-- snippet: synopsis -->``: a usage line with placeholders (``[--samples K]``), parsed with its
  optional parts left out and each placeholder given a value.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:^<!-- snippet: (?P<how>[^>]*?) -->\n)?^```(?P<kind>\w+)\n(?P<body>.*?)^```$", re.M | re.S)
PLACEHOLDERS = {"K": "8", "S": "0"}


@dataclasses.dataclass(frozen=True)
class Snippet:
    page: str
    index: int  # among the page's labelled blocks
    kind: str  # python, sh, yaml, cron
    body: str
    how: str  # "run", "validate", "needs ...", "synopsis"

    @property
    def name(self) -> str:
        return f"{self.page}#{self.index}:{self.kind}"


def snippets(pages: list[str] = PAGES) -> list[Snippet]:
    found = []
    for page in pages:
        text = (ROOT / page).read_text()
        for index, match in enumerate(_BLOCK.finditer(text)):
            kind = match["kind"]
            how = match["how"] or ("validate" if kind == "yaml" else "run")
            found.append(Snippet(page, index, kind, match["body"], how))
    return found


def shell_commands(body: str, kind: str = "sh") -> list[list[str]]:
    """The simple commands of a shell block (or crontab line), each as its words: continuation lines
    joined; comments, redirections and ``&`` left out; ``a && b`` two commands."""
    commands, here_document = [], None
    for line in body.replace("\\\n", " ").splitlines():
        if here_document is not None:  # a here-document's lines are its command's input, not commands
            here_document = None if line.strip() == here_document else here_document
            continue
        found = re.search(r"<<-?\s*'?(\w+)'?", line)
        here_document = found[1] if found else None
        line = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        if kind == "cron" and line.strip():
            line = line.split(None, 5)[5]  # minute hour day month weekday, then the command
        line = re.sub(r"(?<!\S)(\d?>&\d|\d?>>?\s*\S+|<<-?\s*\S+)", "", line)
        for part in re.split(r"&&|\|\||;|&", line):
            words = shlex.split(part)
            if words:
                commands.append(words)
    return commands


def jacobeam_commands(snippet: Snippet) -> list[list[str]]:
    """The arguments of every ``jacobeam`` command in a shell block (the program name left out)."""
    body = snippet.body
    if snippet.how == "synopsis":
        body = re.sub(r"\[[^\]]*\]", "", body)
        body = re.sub(r"\b([A-Z])\b", lambda m: PLACEHOLDERS.get(m[1], m[1]), body)
    return [words[1:] for words in shell_commands(body, snippet.kind) if Path(words[0]).name == "jacobeam"]


def jacobeam_imports(source: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of each ``from jacobeam... import ...`` in Python source."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jacobeam":
            found.append((node.module, [alias.name for alias in node.names]))
    return found
