"""No file in the repository cites a document that is not in it.

Code, docs, tests and deploy files cite documents by path (`docs/design.md`, a relative link, `BENCHMARKS.md`) and by
section (`docs/design.md, "Nothing lost"`, `Contract 2`). Each must resolve inside the repository, so a reader
can follow it: a contract the code relies on lives in docs/design.md, not in a file only its author had. Another
project's file is cited by URL at a commit (a link whose text may be its path); a URL is not checked here.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Names of files a run writes, not documents to read: the GPU server run's BENCHMARKS.md fragment, under $OUT.
WRITTEN = {"gpu_servers.md"}

URL_LINK = re.compile(r"\[[^\]]*\]\(\w+://[^)]*\)")  # a link to another project: its text may name its path
URL = re.compile(r"\w+://\S+")
MD = re.compile(r"(?<![\w/.:-])((?:\.{1,2}/)*[\w.-]+(?:/[\w.-]+)*\.md)\b")
DOCS_PATH = re.compile(r"(?<![\w/.-])((?:docs|shared|research)/[\w./-]*[\w/])")
SECTION = re.compile(
    r"(?:\[[^\]]*\]\(([^)#\s]+)[^)]*\)|(?<![\w/.-])([\w./-]+\.md))"  # a link to a doc, or a doc's path
    r"\)?,?\s+\(?\"([^\"]+)\""  # then its section, quoted: `docs/design.md, "Nothing lost"`
)
CONTRACT = re.compile(r"\bContracts? (\d)(?: and (\d))?")


@cache
def tracked() -> tuple[str, ...]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return tuple(out.split())


@cache
def texts() -> dict[str, str]:
    """Every tracked text file's text, links to other projects and URLs taken out."""
    out = {}
    for path in tracked():
        file = REPO / path
        if file.is_symlink() or not file.is_file():
            continue
        try:
            out[path] = URL.sub("", URL_LINK.sub("", file.read_text()))
        except UnicodeDecodeError:
            continue  # not text
    return out


def resolves(citing: str, ref: str) -> bool:
    """`ref` names a file of the repository: from the citing file's folder, from the root, or as a tracked
    path's tail (a document named in prose: `versions.md`, `trainers/verl.md`)."""
    return ref in tails() or (REPO / citing).parent.joinpath(ref).exists() or (REPO / ref).exists()


@cache
def tails() -> frozenset[str]:
    """Every tracked path and each of its tails: `docs/trainers/verl.md`, `trainers/verl.md`, `verl.md`."""
    parts = (path.split("/") for path in tracked())
    return frozenset("/".join(p[i:]) for p in parts for i in range(len(p)))


def test_every_cited_document_is_in_the_repository() -> None:
    missing = [
        f"{path}: {ref}"
        for path, text in texts().items()
        for pattern in (MD, DOCS_PATH)
        for ref in pattern.findall(text)
        if Path(ref).name not in WRITTEN and not resolves(path, ref)
    ]
    assert not missing, "cite a document in the repository (a contract the code relies on: docs/design.md):\n" + (
        "\n".join(sorted(set(missing)))
    )


def _headings(doc: Path) -> list[str]:
    """A doc's section names: its headings (numbering dropped) and its bold lead-ins (`**Nothing lost**`)."""
    names = []
    for line in doc.read_text().splitlines():
        if heading := re.match(r"#+\s+(?:\d+\.\s+)?(.*)", line):
            names.append(heading.group(1).strip())
        names += [bold.strip() for bold in re.findall(r"\*\*([^*]+)\*\*", line)]
    return names


def test_every_cited_section_is_in_its_document() -> None:
    missing = []
    for path, text in texts().items():
        for link, bare, quoted in SECTION.findall(text):
            ref = link or bare
            doc = next((d for d in ((REPO / path).parent / ref, REPO / ref) if d.is_file()), None)
            section = " ".join(re.sub(r"\n\s*#?", " ", quoted).split())  # a quote may wrap, in a comment too
            if doc is not None and not any(name.startswith(section) for name in _headings(doc)):
                missing.append(f'{path}: {ref}, "{section}"')
    assert not missing, "each cited section is a heading or a bold lead-in of its document:\n" + "\n".join(missing)


def test_every_cited_contract_is_in_the_design() -> None:
    contracts = {
        m.group(1) for m in re.finditer(r"^### Contract (\d+):", (REPO / "docs/design.md").read_text(), re.MULTILINE)
    }
    cited = {(path, n) for path, text in texts().items() for pair in CONTRACT.findall(text) for n in pair if n}
    assert contracts and not [c for c in cited if c[1] not in contracts], sorted(
        c for c in cited if c[1] not in contracts
    )
