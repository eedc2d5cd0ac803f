"""tools/bench_spec.py, the headline benchmark, in its fast mode: two whole
stacks (the ASan builds) on 3 prompts, 16 tokens, 1 and 2 streams, one run.
Its figures are not asserted (the ASan build on a shared machine says
nothing about speed), only what it prints, that every reply was the same
with and without the draft, and its exit status; and that a stack that
does not start or a bad prompts file stops it with a clear message.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from test_services import SERVICE_DIR

sys.path.insert(0, str(ROOT / "tools"))
import bench_spec  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
FAST = ["--streams", "1,2", "--runs", "1", "--max-tokens", "16"]
RUN_KEYS = {"with_draft_tok_s", "without_draft_tok_s", "ratio", "with_draft_cpu_ms_per_token",
            "without_draft_cpu_ms_per_token", "cpu_ratio", "requests", "tokens", "finish_reasons"}


def bench(*args, **kw):
    """bench_spec.py on the ASan services, in a Popen."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    env.setdefault("ASAN_OPTIONS", "detect_leaks=1")
    return subprocess.Popen([sys.executable, str(ROOT / "tools" / "bench_spec.py"), "--build", str(SERVICE_DIR),
                             *map(str, args)], text=True, env=env, cwd=ROOT, **kw)


def run_bench(*args, timeout=1200):
    p = bench(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


@pytest.fixture(scope="module")
def fast(tmp_path_factory, model):
    prompts = write_prompts(tmp_path_factory.mktemp("bench_spec") / "prompts.jsonl", PROMPTS)
    r = run_bench("--prompts", prompts, *FAST)
    assert r.returncode == 0, r.stderr
    return r, prompts


def test_prints_a_line_per_streams_value_then_the_acceptance_then_one_json_line(fast):
    r, _ = fast
    lines = r.stdout.splitlines()
    assert len(lines) == 4, r.stdout
    for n, line in ((1, lines[0]), (2, lines[1])):
        assert re.fullmatch(rf"{n} streams: run 1: [\d.]+ tok/s with the draft, [\d.]+ without, [\d.]+x "
                            r"\(CPU [\d.]+x\); median [\d.]+x \(CPU [\d.]+x\)", line), line
    m = re.fullmatch(r"the target with the draft: mean acceptance length ([\d.]+) over (\d+) draft steps "
                     r"\((\d+) plain steps\); spec (\{.*\})", lines[2])
    assert m, lines[2]
    out = json.loads(lines[3])
    spec = json.loads(m.group(4))
    assert spec == out["draft_target"]["stats"]["spec"]
    assert (int(m.group(2)), int(m.group(3))) == (spec["steps"], spec["plain_steps"])
    mean = (spec["accepted"] + spec["steps"]) / spec["steps"] if spec["steps"] else 0
    assert float(m.group(1)) == out["accept_len_mean"] == round(mean, 3)


def test_json_holds_each_runs_figures_and_their_median(fast):
    r, prompts = fast
    out = json.loads(r.stdout.splitlines()[-1])
    assert set(out) == {"prompts", "prompts_file", "max_tokens", "draft_target_args", "runs", "streams", "identical",
                        "draft_target", "accept_len_mean", "exit_codes", "wall_s"}
    assert out["draft_target_args"] == ""
    assert (out["prompts"], out["prompts_file"], out["max_tokens"], out["runs"]) == (3, str(prompts), 16, 1)
    assert list(out["streams"]) == ["1", "2"]
    # 1 stream: each prompt once per stack; 2 streams: groups of 2, the
    # second wrapping round to the first prompt.
    for n, requests in (("1", 3), ("2", 4)):
        level = out["streams"][n]
        assert set(level) == {"runs", "median_ratio", "median_cpu_ratio"}
        assert len(level["runs"]) == 1
        run = level["runs"][0]
        assert set(run) == RUN_KEYS
        assert run["requests"] == requests
        assert sum(run["finish_reasons"].values()) == requests
        assert set(run["finish_reasons"]) <= {"stop", "length"}
        assert 0 < run["tokens"] <= 16 * requests
        assert run["with_draft_tok_s"] > 0 and run["without_draft_tok_s"] > 0
        # the ratio of the unrounded figures: within what rounding both to
        # 0.01 tok/s (and the ratio to 1e-4) can move it
        w, p = run["with_draft_tok_s"], run["without_draft_tok_s"]
        assert (w - 0.005) / (p + 0.005) - 5e-5 <= run["ratio"] <= (w + 0.005) / (p - 0.005) + 5e-5
        assert level["median_ratio"] == run["ratio"]
        # CPU per token: both stacks did work; the ratio is of those figures
        # (each rounded to 1e-4 ms: within what that can move it)
        cw, cp = run["with_draft_cpu_ms_per_token"], run["without_draft_cpu_ms_per_token"]
        assert cw > 0 and cp > 0
        assert (cp - 5e-5) / (cw + 5e-5) - 5e-5 <= run["cpu_ratio"] <= (cp + 5e-5) / (cw - 5e-5) + 5e-5
        assert level["median_cpu_ratio"] == run["cpu_ratio"]
    # The second level repeats prompt 1 as its fourth request.
    assert out["streams"]["2"]["runs"][0]["tokens"] > out["streams"]["1"]["runs"][0]["tokens"]


def test_every_reply_is_the_same_with_and_without_the_draft_and_every_service_exits_0(fast):
    r, _ = fast
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["identical"] is True
    assert out["exit_codes"] == {"draft": {"gateway": 0, "target": 0, "draft": 0}, "plain": {"gateway": 0, "target": 0}}
    assert "differs" not in r.stderr


def test_json_shows_the_draft_stacks_target_speculating_through_its_draft(fast):
    r, _ = fast
    target = json.loads(r.stdout.splitlines()[-1])["draft_target"]
    assert target["config"]["draft-addr"]["value"].endswith("/draft/draft.sock")
    assert target["config"]["max-batch"] == {"value": 8, "source": "default"}  # a stack at its defaults
    stats = target["stats"]
    assert stats["draft"]["connected"] is True
    assert stats["running"] == stats["waiting"] == 0
    assert stats["requests_done"] == 1 + 3 + 4  # the warm-up, then both levels


def test_draft_target_args_reach_only_the_draft_stacks_target(tmp_path):
    """A fixed one-token chain on every step, by flags: the target says
    where each setting came from, drafts every step, and the text is still
    the plain stack's."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:1])
    flags = "--no-spec-adaptive --spec-steps 1 --spec-topk 1 --spec-tokens 2"
    r = run_bench("--prompts", prompts, "--streams", 1, "--runs", 1, "--max-tokens", 8, "--draft-target-args", flags,
                  timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["draft_target_args"] == flags
    assert out["identical"] is True
    config = out["draft_target"]["config"]
    assert config["spec-adaptive"] == {"value": False, "source": "flag"}
    assert [config[k] for k in ("spec-steps", "spec-topk", "spec-tokens")] == [
        {"value": 1, "source": "flag"}, {"value": 1, "source": "flag"}, {"value": 2, "source": "flag"}]
    spec = out["draft_target"]["stats"]["spec"]
    assert spec["plain_steps"] == 0 and spec["steps"] > 0
    assert spec["drafted"] == spec["steps"]  # one drafted token a step


def test_progress_goes_to_stderr(fast):
    r, _ = fast
    lines = r.stderr.splitlines()
    assert lines[0].startswith("bench_spec: starting the stack with the draft (logs in ")
    assert lines[1].startswith("bench_spec: starting the stack without the draft (logs in ")
    assert "bench_spec: run 1/1, 1 streams: 3 prompts on each stack" in lines
    assert "bench_spec: run 1/1, 2 streams: 3 prompts on each stack" in lines


def test_the_first_prompt_whose_replies_differ_is_named():
    b = bench_spec.Bench.__new__(bench_spec.Bench)
    b.prompts, b.replies = PROMPTS, {}
    b.check("plain", 0, ("Paris.", "stop", 3))
    b.check("draft", 0, ("Paris.", "stop", 3))
    b.check("plain", 2, ("2, 3 and 5", "length", 16))
    with pytest.raises(bench_spec.Differs) as e:
        b.check("draft", 2, ("2, 3 and 7", "length", 16))
    assert str(e.value) == ("the reply to prompt 3 differs: 'List three prime numbers.'\n"
                            "  the stack without the draft: ('2, 3 and 5', 'length', 16)\n"
                            "  the stack with the draft: ('2, 3 and 7', 'length', 16)")


def test_a_stack_that_does_not_start_stops_the_run_with_its_services_last_lines(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a model\n")
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    r = run_bench("--prompts", prompts, "--model", bad, *FAST, timeout=300)
    assert (r.returncode, r.stdout) == (1, "")
    lines = r.stderr.splitlines()
    logs = re.fullmatch(r"bench_spec: the services' logs are in (\S+)", lines[-1]).group(1)
    shutil.rmtree(logs)
    assert lines[1] == (f"bench_spec: the stack with the draft did not start: aerie-draft exited with status 2 "
                        f"while starting; its last lines ({logs}/draft/draft.log):")
    assert lines[-2] == f"    aerie-draft: {bad}: not a GGUF file (magic 6e 6f 74 20, expected 'GGUF')"
    # before it, what the draft logged on the way: the device it chose
    assert 1 <= len(lines[2:-2]) <= 2
    assert all(re.fullmatch(r"    \d{4}-\d\d-\d\dT\S+ info device .+", line) for line in lines[2:-2]), lines


@pytest.mark.parametrize("content, message", [
    ("", "{path}: no prompts"),
    ('{"prompt": "Hi"}\n\n{"text": "Hi"}\n', '{path}:3: no "prompt" string'),
    ('{"prompt": "Hi"}\n["Hi"]\n', '{path}:2: no "prompt" string'),
    ('{"prompt": "Hi"\n', '{path}:1: no "prompt" string'),
])
def test_a_prompts_file_without_prompts_exits_2(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    r = run_bench("--prompts", path, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"bench_spec: {message.format(path=path)}\n")


def service_pids(logs):
    """Processes whose command line names the run's log directory."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and str(logs) in (p / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(p.name))
        except OSError:
            pass  # ended meanwhile
    return pids


def test_sigterm_stops_both_stacks_before_it_exits(tmp_path, model):
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    err = open(tmp_path / "stderr", "w+")
    p = bench("--prompts", prompts, "--streams", 1, "--max-tokens", 4, stdout=subprocess.PIPE, stderr=err)
    logs = None
    try:
        t0 = time.monotonic()
        while "run 1/3" not in (tmp_path / "stderr").read_text():  # both stacks are up
            assert p.poll() is None and time.monotonic() - t0 < 600, (tmp_path / "stderr").read_text()
            time.sleep(0.1)
        logs = re.search(r"logs in (\S+)/draft\)", (tmp_path / "stderr").read_text()).group(1)
        assert len(service_pids(logs)) == 5  # draft, 2 targets, 2 gateways
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 1
        assert json.loads(out)["exit_codes"] == {"draft": {"gateway": 0, "target": 0, "draft": 0},
                                                 "plain": {"gateway": 0, "target": 0}}
        assert service_pids(logs) == []
        assert (tmp_path / "stderr").read_text().splitlines()[-1] == f"bench_spec: the services' logs are in {logs}"
        shutil.rmtree(logs)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for pid in service_pids(logs) if logs else []:  # left behind by a failure here
            os.kill(pid, signal.SIGKILL)
