#!/usr/bin/env python3
"""Names match the map: every name a module gives the rest of the program
starts with the module's file name.

A module is a file pair dir/name.c + dir/name.h. What it exports is checked:
the functions a .c file defines without `static`, and the types, macros,
function pointer types and extern variables its .h file declares. Each must
start with a prefix the module may use (case-insensitive, then '_' or the
end of the name):

  - the file's name, or a leading part of it: `draft_client_` in
    draft_client.c; `safetensors_` in safetensors_write.c, a part of the
    safetensors family; `rpc_` in rpc_conn.c;
  - its folder's library prefix, for a folder that is one library
    (FOLDER_PREFIXES: the kernels, the RPC link, the CLI's shared helpers);
  - `aerie_`, the project's own prefix (include guards, the build's macros).

Names that keep another spelling on purpose are listed in KEEP with the
reason. Exits 1 with one line per name that breaks the rule, naming the file
and the prefixes it may use.

usage: tools/check_names.py [ROOT]
"""
import os
import re
import sys
from pathlib import Path

# The source folders whose files are modules. The binaries' main.c files and
# the architecture descriptions (target/arch/*.c, reached only through their
# arch table) export nothing.
MODULE_DIRS = ["cli", "draft", "gateway", "kernels", "kernels/cpu", "kernels/cuda",
               "services/core", "services/kv", "services/model", "services/rpc",
               "services/spec", "services/tokenizer", "target"]

# Folders that are one library, named by one prefix across their files.
FOLDER_PREFIXES = {
    "kernels": ["kn"],
    "kernels/cpu": ["kn"],
    "kernels/cuda": ["kn", "kcu"],  # kcu_: the CUDA backend's own helpers
    "services/rpc": ["rpc", "frame"],
    "cli": ["cli"],
}

KEEP = {
    "ae_error": "the error type every module passes; its prefix is the project's",
    "AE_ASSERT": "the project-wide assertion that goes with ae_error",
    "AE_ERR_MAX": "the size of ae_error's message",
    "ggml_type": "GGUF's own name for its tensor type enum, spelled as the file format spells it",
    "main": "a program's entry point",
}


def strip(text: str) -> str:
    """The text without comments, string literals, line continuations and
    the bodies of braces (function bodies, struct members, initializers)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\\n])*'", "''", text)
    text = re.sub(r"\\\n", " ", text)
    out, depth = [], 0
    for ch in text:
        if ch == "{":
            depth += 1
        if depth == 0:
            out.append(ch)
        if ch == "}":
            depth -= 1
    return "".join(out)


def exported(path: Path):
    """The names a file gives other files."""
    raw = path.read_text()
    t = strip(raw)
    names = set()
    header = path.suffix == ".h"
    # Macros that spell `static` (#define INL static inline ...).
    static_macros = set(re.findall(r"^#\s*define\s+(\w+)\b[^\n]*\bstatic\b", raw, flags=re.M))
    for m in re.finditer(r"^(?!#|\s)([^;#]*?)\b(\w+)\s*\(", t, flags=re.M):
        lead = m.group(1)
        if lead.startswith("typedef"):
            if not header:
                continue  # a .c file's own function type
            fp = re.match(r"typedef[^(;]*\(\s*\*\s*(\w+)\s*\)", t[m.start():])
            if fp:
                names.add(fp.group(1))
            continue
        if re.search(r"\bstatic\b", lead) or set(re.findall(r"\w+", lead)) & static_macros or "=" in lead or lead.strip() == "":
            continue  # internal, or a call at file scope (a macro's use)
        if re.search(r"\b(extern\s+\"C\"|__global__|__device__)\b", lead) and "__host__" not in lead:
            continue
        names.add(m.group(2))
    if header:
        for m in re.finditer(r"^typedef\b[^;(]*?\b(\w+)\s*;", t, flags=re.M):
            names.add(m.group(1))
        for m in re.finditer(r"^#\s*define\s+(\w+)", t, flags=re.M):
            names.add(m.group(1))
        for m in re.finditer(r"^extern\s[^;(]*?\b(\w+)\s*(?:\[[^\]]*\])?\s*;", t, flags=re.M):
            names.add(m.group(1))
    return names - {"__attribute__", "_Static_assert", "static_assert", "__launch_bounds__"}


def prefixes(folder: str, stem: str):
    words = stem.split("_")
    own = ["_".join(words[:k]) for k in range(1, len(words) + 1)]
    return own + FOLDER_PREFIXES.get(folder, []) + ["aerie"]


def allowed(name: str, pre) -> bool:
    low = name.lower()
    return name in KEEP or any(low == p or low.startswith(p + "_") for p in pre)


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    bad = []
    n_files = n_names = 0
    for folder in MODULE_DIRS:
        for path in sorted((root / folder).glob("*")):
            if path.suffix not in (".c", ".h", ".cu") or path.name == "main.c":
                continue
            pre = prefixes(folder, path.stem)
            names = exported(path)
            n_files += 1
            n_names += len(names)
            for name in sorted(names):
                if not allowed(name, pre):
                    bad.append(f"{folder}/{path.name}: '{name}' does not start with "
                               + " or ".join(p + "_" for p in pre))
    for line in bad:
        print(line)
    print(f"check_names: {n_names} exported names in {n_files} files, {len(bad)} off the map")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
