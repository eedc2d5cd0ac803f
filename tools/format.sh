#!/usr/bin/env bash
# The tree's C, C++ and CUDA layout (.clang-format), with the one pinned
# clang-format version, so that everyone's tool breaks lines the same way.
#
#   tools/format.sh           rewrite every file that is off (make format)
#   tools/format.sh --check   change nothing; list the files that are off,
#                             show the first lines of each diff, exit 1
#                             (make check, make test)
#
# The version comes from PyPI (clang-format==19.1.7, installed by
# tools/deps.sh test); a system clang-format of another version is not
# used, since versions differ in where they break lines.
set -uo pipefail
cd "$(dirname "$0")/.."

WANT=19.1.7
check=false
[ "${1:-}" = --check ] && check=true

cf=$(python3 -c 'import clang_format, os; print(os.path.join(os.path.dirname(clang_format.__file__), "data", "bin", "clang-format"))' 2>/dev/null)
if [ -z "$cf" ] || [ ! -x "$cf" ]; then
    echo "format: clang-format $WANT is not installed: run tools/deps.sh test (or pip install clang-format==$WANT)" >&2
    exit 2
fi
have=$("$cf" --version | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -n 1)
if [ "$have" != "$WANT" ]; then
    echo "format: clang-format $have is installed, the tree's layout is $WANT's: pip install clang-format==$WANT" >&2
    exit 2
fi

# Every C, C++ and CUDA file git tracks or would add, but for
# .clang-format-ignore's (generated files).
mapfile -t files < <(git ls-files --cached --others --exclude-standard -- '*.c' '*.h' '*.cc' '*.cu' |
    grep -vxF -f <(grep -v '^#' .clang-format-ignore | sed '/^$/d'))
off=()
for f in "${files[@]}"; do
    [ -f "$f" ] || continue
    if ! "$cf" --style=file "$f" | cmp -s - "$f"; then
        off+=("$f")
        if $check; then
            echo "format: $f is off the layout:"
            "$cf" --style=file "$f" | diff -u "$f" - | sed -n '3,14p' | sed 's/^/    /'
        else
            "$cf" --style=file -i "$f"
        fi
    fi
done
if $check; then
    echo "format: ${#files[@]} files, ${#off[@]} off the layout (clang-format $have)"
    [ ${#off[@]} -eq 0 ] || { echo "format: run tools/format.sh (make format) to fix them" >&2; exit 1; }
else
    echo "format: ${#files[@]} files, ${#off[@]} rewritten (clang-format $have)"
fi
