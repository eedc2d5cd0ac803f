"""`make run` (tools/run.sh) supervises its three services the way systemd
would: one that dies is started again with backoff while the others keep
serving.

Each test runs tools/run.sh itself on a free port, in its own process
group, and reads the lines it prints ("run: draft started pid=N", "run:
draft exited (signal 9); restarting in 0.5 s"). It uses the release
binaries in build/, as `make run` does.
"""
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import openai
import pytest

import aerie_rpc as rpc
from conftest import ROOT
from test_gateway import chat, greedy_reference, stream_text

QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow."]
MAX_TOKENS = 24


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """tools/run.sh on a free port; its output is collected line by line."""

    def __init__(self, tmp):
        for b in ("aerie-draft", "aerie-target", "aerie-gateway"):
            if not (ROOT / "build" / b).exists():
                pytest.fail(f"build/{b} is missing: run `make all` first")
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
        env["AERIE_PORT"] = str(self.port)
        self.log = open(tmp / "run.log", "w+")
        self.lines = []
        self.cv = threading.Condition()
        self.proc = subprocess.Popen(["tools/run.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.name = self.wait_line(r"^Aerie is serving (\S+) at", 120)[0].group(1)

    def _read(self):
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            with self.cv:
                self.lines.append(line.rstrip("\n"))
                self.cv.notify_all()

    def wait_line(self, pattern, timeout, start=0):
        """The first match of pattern among the lines from index start on,
        and the index after it."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        with self.cv:
            i = start
            while True:
                while i < len(self.lines):
                    m = rx.search(self.lines[i])
                    i += 1
                    if m:
                        return m, i
                left = end - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.reader.is_alive()):
                    tail = "\n".join(self.lines[-15:])
                    pytest.fail(f"no line matching {pattern!r} in {timeout} s; run.sh printed:\n{tail}")
                self.cv.wait(min(left, 0.5))

    def pid(self, short):
        """The pid of the live aerie-SHORT in run.sh's session (found in
        /proc, so that it does not depend on what run.sh prints)."""
        found = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    head, rest = f.read().rsplit(")", 1)
            except OSError:
                continue
            fields = rest.split()
            if head.endswith(f"(aerie-{short}") and fields[0] != "Z" and int(fields[3]) == self.proc.pid:
                found.append(int(d))
        assert len(found) == 1, f"aerie-{short} processes in run.sh's session: {found}"
        return found[0]

    def client(self):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0,
                             timeout=120)

    def stop(self):
        """SIGTERM, as Ctrl-C's stop does; whatever is left of the group is killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.reader.join(10)
        self.log.close()


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.stop()


def test_draft_killed_three_times_while_8_streams_run_is_restarted_and_every_stream_completes(run, model):
    refs = [greedy_reference(model, chat(q), MAX_TOKENS) for q in QUESTIONS]
    kills_done = threading.Event()
    results, errors = [], []

    def streamer(k):
        # Requests back to back until the kills are over (bounded), so
        # that streams are running through every kill.
        c = run.client()
        for n in range(40):
            q = (k + n) % len(QUESTIONS)
            try:
                text, finish, _u, _r = stream_text(c.chat.completions.create(
                    model=run.name, messages=chat(QUESTIONS[q]), max_tokens=MAX_TOKENS, temperature=0, stream=True))
                results.append((q, text, finish))
            except Exception as e:  # noqa: BLE001: reported below
                errors.append(repr(e))
            if kills_done.is_set():
                return

    threads = [threading.Thread(target=streamer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    try:
        at = 0
        for kill in range(4):
            if kill > 0:
                m, at = run.wait_line(r"^run: draft started pid=(\d+)$", 30, at)
            # Killed only once the target has connected to it.
            conn, at = run.wait_line(r"^\[target\] .*rpc_connected addr=(unix:\S*/draft\.sock)$", 60, at)
            pid = run.pid("draft")
            assert kill == 0 or pid == int(m.group(1))
            if kill == 3:
                break
            os.kill(pid, signal.SIGKILL)
            _, at = run.wait_line(r"^run: draft exited \(signal 9\); restarting in [0-9.]+ s$", 10, at)
    finally:
        kills_done.set()
        for t in threads:
            t.join(300)
    assert errors == []
    assert len(results) >= 8
    for q, text, finish in results:
        assert (text, finish in ("stop", "length")) == (refs[q], True)
    # The gateway and the target were never restarted. (Their supervisors
    # start side by side, so the two lines come in either order.)
    assert sorted(l for l in run.lines if re.match(r"^run: (target|gateway) (exited|started)", l)) == \
        [f"run: gateway started pid={run.pid('gateway')}", f"run: target started pid={run.pid('target')}"]
    assert run.proc.poll() is None
    # The last draft serves: it answers Info, and the target is connected
    # to it. (Whether the target sends it a Propose in a given second is
    # adaptive speculation's choice, so its call count proves nothing.)
    draft_addr = conn.group(1)
    _r, _stats, dcfg = rpc.info(draft_addr, "DRAFT_INFO")  # asserts an OK reply
    assert dcfg["listen"]["value"] == draft_addr
    _r, tstats, _c = rpc.info(draft_addr.replace("/draft.sock", "/target.sock"))
    assert tstats["draft"]["connected"] is True


def post(port, path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    return r.status, r.getheader("Retry-After"), text


def test_target_killed_gateway_answers_503_with_retry_after_until_it_is_back(run, model):
    ref = greedy_reference(model, chat(QUESTIONS[0]), MAX_TOKENS)
    body = {"model": run.name, "messages": chat(QUESTIONS[0]), "max_tokens": MAX_TOKENS, "temperature": 0}
    st, _ra, text = post(run.port, "/v1/chat/completions", body)
    assert st == 200 and json.loads(text)["choices"][0]["message"]["content"] == ref
    old = run.pid("target")
    os.kill(old, signal.SIGKILL)
    _, at = run.wait_line(r"^run: target exited \(signal 9\); restarting in [0-9.]+ s$", 10)
    # Until the new target is up, every answer is 503 with Retry-After;
    # then it serves the same text again.
    seen = []
    end = time.monotonic() + 120
    while True:
        assert time.monotonic() < end, f"no 200 in 120 s after the kill: {seen[-3:]}"
        st, ra, text = post(run.port, "/v1/chat/completions", body)
        if st == 200:
            break
        seen.append((st, ra))
        time.sleep(0.05)
    assert seen and set(seen) == {(503, "1")}
    assert json.loads(text)["choices"][0]["message"]["content"] == ref
    m, _ = run.wait_line(r"^run: target started pid=(\d+)$", 1, at)
    assert int(m.group(1)) == run.pid("target") != old
    assert run.proc.poll() is None
