"""The docs stay short and free of run/session history, and every link into them resolves; no
tracked file speaks of a remote runner's output folder or device, and bench/'s scripts each take an
output folder and embed no heredoc (issue 41's layout)."""

from __future__ import annotations

import ast
import math
import operator
import posixpath
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/design.md", "docs/perf-notes.md")

# The issue's acceptance bar: "perf notes <= 800 lines" (what is true now plus the tried-and-dropped
# table; the history stays in git).
PERF_NOTES_MAX_LINES = 800

# Run and session tags are history; the notes say what is true of the code as it ships.
HISTORY_TAGS = (re.compile(r"\[run \d+\]", re.IGNORECASE), re.compile(r"\bsession \d+\b", re.IGNORECASE))

# A markdown link into either file, its path relative to the linking file: [text](../docs/design.md#<anchor>)
MD_LINK = re.compile(r"\]\(([^()\s#]*(?:perf-notes|design)\.md)#([^()\s]+)\)")
# A plain mention from the repository root, as code comments write it: docs/design.md#<anchor>
ROOT_MENTION = re.compile(r"(?<![\w/.-])(docs/(?:perf-notes|design)\.md)#([\w-]+)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation other than '-' and '_' dropped, spaces -> '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def tracked_files() -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed: cannot list the tracked files whose links to check")
    done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"not a git checkout ({done.stderr.strip()}): cannot list the tracked files")
    return done.stdout.splitlines()


def links(rel: str, text: str) -> list[tuple[str, str, int]]:
    """(target file from the root, anchor, line) of each link or mention in a file at rel."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in MD_LINK.finditer(line):
            target = posixpath.normpath(posixpath.join(posixpath.dirname(rel), match.group(1)))
            out.append((target, match.group(2), number))
        for match in ROOT_MENTION.finditer(line):
            out.append((match.group(1), match.group(2), number))
    return out


def test_slug_matches_githubs_anchors():
    assert slug("The product kernel (`fo_kernels.gemm.pingpong`, `Tile.pingpong`)") == (
        "the-product-kernel-fo_kernelsgemmpingpong-tilepingpong"
    )
    assert slug("AllGather + GEMM") == "allgather--gemm"
    assert slug("TP=4 and TP=8, predicted") == "tp4-and-tp8-predicted"


def test_duplicate_headings_get_numbered_anchors(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Notes\n## Measured\n```\n# not a heading\n```\n## Measured\n### Measured\n")
    assert anchors(doc) == {"notes", "measured", "measured-1", "measured-2"}


def test_perf_notes_within_the_issues_line_bar():
    lines = (ROOT / "docs/perf-notes.md").read_text().splitlines()
    assert len(lines) <= PERF_NOTES_MAX_LINES, f"docs/perf-notes.md has {len(lines)} lines"


@pytest.mark.parametrize("doc", DOCS)
def test_docs_carry_no_run_or_session_tags(doc):
    found = [
        f"{doc}:{number}: {match.group(0)}"
        for number, line in enumerate((ROOT / doc).read_text().splitlines(), 1)
        for pattern in HISTORY_TAGS
        for match in pattern.finditer(line)
    ]
    assert not found, found


# The packages whose modules the design guide's module map names, one by one.
MAPPED_PACKAGES = ("kernels", "fo_tune")


def _module_map() -> str:
    text = (ROOT / "docs/design.md").read_text()
    return text.split("## Module map", 1)[1].split("\n## ", 1)[0]


def _map_entries() -> dict[tuple[str, str], str]:
    """The module map's entries: (package, head) -> the entry's text. A package line starts at column
    0 (``kernels/``), an entry at column 2 with its head before the first run of spaces (``table/``,
    ``errors.py``, ``__init__.py, output.py``); deeper lines continue the entry above."""
    block = _module_map().split("```", 2)[1]
    entries: dict[tuple[str, str], str] = {}
    package, key = "", None
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        if not line.startswith(" "):
            package, key = line.split()[0].rstrip("/"), None
        elif not line.startswith("   "):
            key = (package, re.split(r"\s{2,}", line.strip(), maxsplit=1)[0])
            entries[key] = line
        elif key is not None:
            entries[key] += " " + line.strip()
    return entries


def _heads(head: str) -> list[str]:
    return [part.strip() for part in head.split(",")]


def test_module_map_names_every_module_in_its_entry():
    """Every module of the runtime and the tuner is named in the module map's entry for its file or
    folder (``kernels/table/spans.py`` in the ``table/`` entry), and opens with a docstring saying what
    it owns."""
    entries = _map_entries()
    unnamed, bare = [], []
    for package in MAPPED_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT / package).as_posix()
            texts = [
                text
                for (owner, head), text in entries.items()
                if owner == package
                and any(rel == part or (part.endswith("/") and rel.startswith(part)) for part in _heads(head))
            ]
            named = any(path.stem in re.findall(r"\w+", text) for text in texts)
            if not texts or (path.stem != "__init__" and not named):
                unnamed.append(f"{package}/{rel}")
            if not ast.get_docstring(ast.parse(path.read_text())):
                bare.append(f"{package}/{rel}")
    assert not unnamed, f"not named in its entry of docs/design.md's module map: {unnamed}"
    assert not bare, f"modules without a docstring: {bare}"


def test_module_map_names_only_what_exists():
    """Each entry's head and every ``name.py`` its text names is a file or folder of its package."""
    entries = _map_entries()
    assert {package for package, _ in entries} >= set(MAPPED_PACKAGES), "the module map's packages moved"
    gone = []
    for (package, head), text in entries.items():
        if package not in MAPPED_PACKAGES:
            continue
        for part in _heads(head):
            if not (ROOT / package / part).exists():
                gone.append(f"{package}/{part}")
        folder = ROOT / package / (head if head.endswith("/") else posixpath.dirname(head))
        for name in re.findall(r"\b(\w+\.py)\b", text.strip().split(None, 1)[-1]):
            if not (folder / name).exists():
                gone.append(f"{package}/{head}: {name}")
    assert not gone, f"docs/design.md's module map names what does not exist: {gone}"


@pytest.mark.parametrize("package", [*MAPPED_PACKAGES, "bench"])
def test_code_carries_no_run_or_session_tags(package):
    found = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)}"
        for path in sorted((ROOT / package).rglob("*"))
        if path.suffix in (".py", ".sh")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for pattern in HISTORY_TAGS
        for match in pattern.finditer(line)
    ]
    assert not found, found


def test_links_into_the_docs_resolve():
    targets = {doc: anchors(ROOT / doc) for doc in DOCS}
    broken, checked = [], 0
    for rel in tracked_files():
        path = ROOT / rel
        if path == Path(__file__).resolve() or not path.is_file():  # its own examples are not links
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for target, anchor, number in links(rel, text):
            checked += 1
            if target not in targets:
                broken.append(f"{rel}:{number}: {target} is not one of {DOCS}")
            elif anchor not in targets[target]:
                broken.append(f"{rel}:{number}: {target}#{anchor} names no heading")
    assert checked, "no links into the docs found"
    assert not broken, "\n".join(broken)


# What a remote machine's call limits leave in scripts that were written around them: its output
# folder's variable and its loan of the device (the word spelled apart here so this file is clean).
REMOTE_RUNNER_WORDS = (re.compile(r"\$\{?OUT\b"), re.compile(r"\bdevice " + "lease", re.IGNORECASE))
# A heredoc (``<<EOF``, ``<<-'EOF'``); a here-string (``<<<``) is a plain argument.
HEREDOC = re.compile(r"(?<!<)<<-?(?!<)\s*['\"]?[A-Za-z_]")


def test_no_tracked_file_speaks_of_a_remote_runners_folder_or_device():
    found = []
    for rel in tracked_files():
        path = ROOT / rel
        try:
            text = path.read_text() if path.is_file() else ""
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{rel}:{number}: {m.group(0)}" for p in REMOTE_RUNNER_WORDS for m in p.finditer(line)]
    assert not found, found


def test_bench_scripts_take_an_output_folder_and_embed_no_heredoc():
    """Each of bench/'s scripts writes under the folder it is given (a shell script's first argument
    through env.sh's fo_out_dir, a Python one's --out) and carries no heredoc (its Python is a module
    of the package)."""
    scripts = sorted((ROOT / "bench").glob("*.sh")) + sorted((ROOT / "bench").glob("*.py"))
    assert len(scripts) > 5, scripts
    bad = []
    for path in scripts:
        text = path.read_text()
        if path.suffix == ".sh":  # (Python's << is a shift)
            lines = enumerate(text.splitlines(), 1)
            bad += [f"{path.name}:{n}: heredoc" for n, line in lines if HEREDOC.search(line)]
        if path.name == "env.sh":  # sourced by the others: it defines fo_out_dir
            continue
        takes = 'fo_out_dir "$1"' in text if path.suffix == ".sh" else '"--out"' in text
        if not takes:
            bad.append(f"{path.name}: takes no output folder")
    assert not bad, bad


# A passage cited by name, as code comments and docs write it: docs/perf-notes.md, "The split tail"
# (and more names after it: , "Other" or and "Other"), the comment markers of wrapped lines dropped.
NAMED = re.compile(
    r"(docs/)?(perf-notes|design)\.md(?:#[\w-]+)?,?\s+((?:\"[^\"\n]{2,160}\"(?:,\s*|\s+and\s+)?)+)"
)
WRAPPED = re.compile(r"\n[ \t]*(?:#+|//|\*)?[ \t]*")


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_passages_cited_by_name_exist():
    """A quoted name after a doc is one of its headings (or a heading's start) or a sentence in it."""
    docs = {}
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        heads = [re.sub(r"^#+\s*", "", line).strip() for line in text.splitlines() if line.startswith("#")]
        docs[doc.split("/")[1].removesuffix(".md")] = (heads, _flat(text))
    missing, checked = [], 0
    for rel in tracked_files():
        path = ROOT / rel
        if (
            path == Path(__file__).resolve()
            or not path.is_file()
            or path.suffix not in (".py", ".md", ".yaml", ".sh")
        ):
            continue
        flat = WRAPPED.sub(" ", path.read_text())
        for match in NAMED.finditer(flat):
            heads, body = docs[match.group(2)]
            for name in re.findall(r"\"([^\"]+)\"", match.group(3)):
                checked += 1
                name = _flat(name)
                if not any(h.startswith(name) for h in heads) and name not in body:
                    missing.append(f"{rel}: {match.group(2)}.md, {name!r}")
    assert checked, "no passage cited by name found"
    assert not missing, "\n".join(missing)


# A constant the docs quote with its value: `TABLE_RECHECK_S` = 1 s, `SPLIT_MIN_MACS` = 2^35,
# `GROUPED_UP_OVERHEAD` = 3.20 / 2.89. Table rows are left out (perf-notes' tried-and-dropped table
# quotes values the code no longer has).
QUOTED_CONSTANT = re.compile(r"`([A-Z][A-Z0-9_]{3,})` = (\d[\d.]*(?:\^\d+)?(?: / \d[\d.]*)?)")
ARITHMETIC = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
}


def _number(node: ast.expr) -> float | None:
    """The value of a constant arithmetic expression (``1 << 35``, ``3.20 / 2.89``), else None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
        left, right = _number(node.left), _number(node.right)
        if left is not None and right is not None:
            return ARITHMETIC[type(node.op)](left, right)
    return None


def _module_constants() -> dict[str, list[float]]:
    """Every numeric module-level constant of the runtime and the tuner: name -> its values (a
    name may be defined in more than one module)."""
    found: dict[str, list[float]] = {}
    for package in MAPPED_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target = node.targets[0]
                elif isinstance(node, ast.AnnAssign) and node.value is not None:
                    target = node.target
                else:
                    continue
                value = _number(node.value)
                if isinstance(target, ast.Name) and value is not None:
                    found.setdefault(target.id, []).append(float(value))
    return found


def test_constants_the_docs_quote_have_those_values():
    """A constant named with its value in the docs (`NAME` = value) has that value in the code."""
    constants = _module_constants()
    wrong, checked = [], 0
    for rel in (*DOCS, "README.md"):
        for number, line in enumerate((ROOT / rel).read_text().splitlines(), 1):
            if line.lstrip().startswith("|"):
                continue
            for name, quoted in QUOTED_CONSTANT.findall(line):
                value = _number(ast.parse(quoted.replace("^", "**"), mode="eval").body)
                checked += 1
                if not any(math.isclose(value, v, rel_tol=1e-9) for v in constants.get(name, [])):
                    wrong.append(f"{rel}:{number}: {name} = {quoted}, the code: {constants.get(name)}")
    assert checked, "no quoted constant found"
    assert not wrong, "\n".join(wrong)
