"""The documents stay true to the tree: README.md fits a newcomer's first
screens, every relative link and every repository path the documents name
exists, nothing cites a file outside the repository, and docs/cli.md names
exactly the flags each binary's --help lists.

The binaries are found as the other tests find them: `aerie` at AERIE_BIN
(conftest.py), the services in AERIE_SERVICE_DIR (test_services.py); both
default to the ASan build."""
import glob
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, aerie_bin
from test_services import SERVICE_DIR

README = ROOT / "README.md"
CLI_DOC = ROOT / "docs" / "cli.md"
README_MAX_LINES = 150
SERVICES = ("aerie-target", "aerie-draft", "aerie-gateway")

# Spelled in two parts so that this file does not mention them itself.
OUTSIDE = ("DESIGN" + ".md", "../" + "shared")

# A flag: --name, where a name is lower-case words joined by '-' (a trailing
# '-', as in `--no-`, or a capital after it, as in `--no-NAME`, is no flag).
FLAG = re.compile(r"--[a-z][a-z0-9-]*[a-z0-9](?![A-Za-z0-9_-])")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def documents():
    return [README, ROOT / "ARCHITECTURE.md", ROOT / "deploy" / "README.md",
            *sorted((ROOT / "docs").glob("*.md"))]


def repo_files():
    """Every file of the tree that git would commit (tracked, or new and
    not ignored)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return sorted({ROOT / p for p in out.decode().split("\0") if p and (ROOT / p).is_file()})


def top_folders():
    return sorted({p.relative_to(ROOT).parts[0] for p in repo_files() if len(p.relative_to(ROOT).parts) > 1})


def prose(text: str) -> str:
    """The text without its fenced code blocks."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(md: Path):
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", prose(md.read_text()), flags=re.M)}


def test_the_readme_fits_in_150_lines():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines, more than {README_MAX_LINES}: move the rest to docs/"


def test_every_relative_link_resolves():
    bad = []
    for doc in documents():
        for target in LINK.findall(prose(doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)}: ({target})"
            if ROOT not in dest.parents and dest != ROOT:
                bad.append(f"{where} leaves the repository")
            elif not dest.exists():
                bad.append(f"{where} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} has no heading #{anchor}")
    assert bad == [], "\n".join(bad)


def test_every_repository_path_in_backticks_exists():
    folders = top_folders()
    assert "target" in folders and "docs" in folders and "build" not in folders, folders
    path = re.compile(r"^(?:%s)/[\w.*/-]*$" % "|".join(map(re.escape, folders)))
    bad = []
    for doc in documents():
        for span in CODE_SPAN.findall(prose(doc.read_text())):
            for word in span.split():
                word = word.rstrip(",;:)")
                if path.match(word) and not glob.glob(str(ROOT / word)):
                    bad.append(f"{doc.relative_to(ROOT)}: `{word}`")
    assert bad == [], "\n".join(bad)


def test_no_file_cites_a_design_document_outside_the_repository():
    bad = []
    for f in repo_files():
        data = f.read_bytes()
        if b"\0" in data[:8192]:
            continue  # a binary file
        text = data.decode("utf-8", errors="replace")
        bad += [f"{f.relative_to(ROOT)}: {s}" for s in OUTSIDE if s in text]
    assert bad == [], "\n".join(bad)


# ---- docs/cli.md against --help -------------------------------------------


def run_help(argv):
    r = subprocess.run([str(a) for a in argv] + ["--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, f"{argv} --help exited {r.returncode}: {r.stderr}"
    return r.stdout + r.stderr


def options(help_text: str):
    """The options a --help lists: {name: boolean?}."""
    opts = {}
    for line in help_text.splitlines():
        m = re.match(r"^  (--[a-z][a-z0-9-]*)\s(.*)$", line)
        if m:
            opts[m.group(1)] = bool(re.search(r"\(default: (true|false)\)$", m.group(2)))
    return opts


@pytest.fixture(scope="module")
def helps():
    """{section heading: options} for `aerie COMMAND` and each service."""
    binary = aerie_bin()
    if not binary.exists():
        pytest.fail(f"{binary} is missing: run `make asan` first")
    top = run_help([binary])
    commands = re.findall(r"^  ([a-z][a-z-]+)  ", top.split("commands:", 1)[1], flags=re.M)
    assert "generate" in commands and "plan" in commands, top
    out = {f"aerie {c}": options(run_help([binary, c])) for c in commands}
    for s in SERVICES:
        b = SERVICE_DIR / s
        if not b.exists():
            pytest.fail(f"{b} is missing: run `make asan` first")
        out[s] = options(run_help([b]))
    assert all(out.values()), [k for k, v in out.items() if not v]
    return out


def cli_sections():
    """{heading: text} of docs/cli.md's second-level sections; the text
    before the first binary's section is under ''."""
    sections, name = {"": ""}, ""
    for line in CLI_DOC.read_text().splitlines():
        m = re.match(r"^## (.*)$", line)
        if m:
            name = m.group(1).strip() if re.match(r"^aerie[ -]", m.group(1)) else name
            sections.setdefault(name, "")
        sections[name] += line + "\n"
    return sections


def known(flag, opts):
    if flag in opts or flag == "--help":
        return True
    return flag.startswith("--no-") and opts.get("--" + flag[5:], False)


def test_every_flag_in_cli_md_is_in_its_binarys_help(helps):
    bad = []
    for name, text in cli_sections().items():
        flags = sorted(set(FLAG.findall(text)))
        if name == "":  # the settings every binary takes
            bad += [f"(every binary) {f} not in {b}'s --help" for f in flags for b, o in helps.items()
                    if not known(f, o)]
        elif name not in helps:
            bad.append(f"'## {name}': no such command or service")
        else:
            bad += [f"'## {name}': {f} is not in its --help" for f in flags if not known(f, helps[name])]
    assert bad == [], "\n".join(bad)


def test_every_option_of_every_binary_is_in_cli_md(helps):
    sections = cli_sections()
    bad = []
    for name, opts in helps.items():
        if name not in sections:
            bad.append(f"docs/cli.md has no '## {name}'")
            continue
        named = set(FLAG.findall(sections[name] + sections[""]))
        bad += [f"'## {name}' does not name {o}" for o in opts if o not in named]
    assert bad == [], "\n".join(bad)
