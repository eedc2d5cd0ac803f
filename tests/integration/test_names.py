"""tools/check_names.py: every exported name starts with its module's file
name, and the check fails, naming the file and the prefixes allowed, when
one does not."""
import subprocess
import sys

from conftest import ROOT

CHECK = ROOT / "tools" / "check_names.py"


def run(root):
    return subprocess.run([sys.executable, str(CHECK), str(root)], capture_output=True, text=True)


def test_the_tree_is_on_the_map():
    r = run(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].endswith("files, 0 off the map")


def test_a_name_off_the_map_is_reported(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "draft_client.h").write_text(
        "#ifndef AERIE_TARGET_DRAFT_CLIENT_H\n"
        "#define AERIE_TARGET_DRAFT_CLIENT_H\n"
        "typedef struct draft_client draft_client;\n"
        "typedef int (*dcli_cb)(void *arg);\n"
        "#define DCLI_MAX 4\n"
        "int draft_client_open(draft_client **out);\n"
        "#endif\n")
    (tmp_path / "target" / "draft_client.c").write_text(
        "#include \"draft_client.h\"\n"
        "static int helper(void) { return 0; }\n"
        "int draft_client_open(draft_client **out) { *out = 0; return helper(); }\n"
        "void dcli_close(draft_client *c) { (void)c; }\n")
    r = run(tmp_path)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        "target/draft_client.c: 'dcli_close' does not start with draft_ or draft_client_ or aerie_",
        "target/draft_client.h: 'DCLI_MAX' does not start with draft_ or draft_client_ or aerie_",
        "target/draft_client.h: 'dcli_cb' does not start with draft_ or draft_client_ or aerie_",
        "check_names: 7 exported names in 2 files, 3 off the map",
    ]
