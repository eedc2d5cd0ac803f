"""The services under the confinement their systemd units give them:
SystemCallFilter=@system-service (only those calls, of the native ABI),
UMask=, and for the gateway MemoryDenyWriteExecute= (prctl PR_SET_MDWE).

tools/run_confined.py applies each unit's own settings, read from deploy/,
and execs the release binary the unit runs; a call outside the filter is
named in the service's log ("run_confined: refused NAME") and answered
EPERM, as the unit's SystemCallErrorNumber=EPERM would answer it. The
stack then serves real requests through the gateway, plain, streamed and
structured (a grammar for json_object and for a schema), and no service
may have made a refused call.
"""
import json
import os
import re
import signal
import stat
import subprocess
import time

import jsonschema
import openai
import pytest

import aerie_rpc as rpc
from conftest import ROOT
from test_gateway import request, stream_text
from test_services import HEAD

DEPLOY = ROOT / "deploy"
LAUNCHER = ROOT / "tools" / "run_confined.py"
# python3-seccomp is Debian's package for Debian's python3; pytest may run
# under another python.
PY = "/usr/bin/python3"
REFUSED = "run_confined: refused "
CTX = 512


def have_seccomp():
    if not os.path.exists(PY):
        pytest.fail(f"{PY} is missing: tools/deps.sh test installs python3-seccomp, which brings it")
    r = subprocess.run([PY, "-c", "import seccomp"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"{PY} cannot import seccomp ({r.stderr.strip()[-200:]}): tools/deps.sh test installs "
                    "python3-seccomp")


def confined(*opts):
    return [PY, str(LAUNCHER), *opts, "--"]


def probe(code, *opts):
    """Debian's python3 running CODE under the launcher: (rc, stdout, stderr)."""
    have_seccomp()
    r = subprocess.run(confined(*opts) + [PY, "-c", code], capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout, r.stderr


def test_the_list_is_systemds_group_with_nested_groups_and_no_foreign_names():
    have_seccomp()
    r = subprocess.run(confined("--unit", DEPLOY / "aerie-target@.service", "--list"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    allowed = set(r.stdout.split())
    # What forking a child to compile a schema in takes, and threads.
    assert {"fork", "clone", "clone3", "pipe2", "kill", "wait4", "prlimit64", "setrlimit", "prctl", "execve",
            "futex", "epoll_wait", "sendmsg", "mmap"} <= allowed
    # From groups nested in @system-service only (@aio, @network-io,
    # @io-event), and from @default, which an allow-list starts from.
    assert {"io_uring_setup", "accept4", "epoll_create1", "getrandom"} <= allowed
    # Outside the group: debugging, mounting, modules, the clock, swap.
    assert allowed.isdisjoint({"ptrace", "mount", "init_module", "clock_settime", "swapon", "reboot", "bpf"})
    # Names the group lists that are no call on x86-64 (or arm64) are skipped.
    assert "mmap2" not in allowed and "oldolduname" not in allowed
    r = subprocess.run(confined("--filter", "@system-service", "--filter", "~@process", "--list"),
                       capture_output=True, text=True, timeout=60)
    narrower = set(r.stdout.split())
    assert r.returncode == 0 and "fork" not in narrower and "wait4" not in narrower
    assert narrower < allowed


PTRACE = ("import ctypes, seccomp\n"
          "libc = ctypes.CDLL(None, use_errno=True)\n"
          "nr = seccomp.resolve_syscall(seccomp.Arch.NATIVE, 'ptrace')\n"
          "print(libc.syscall(nr, 2, 999999999, 0, 0), ctypes.get_errno(), flush=True)\n")


def test_a_call_outside_the_filter_is_named_and_answered_eperm_or_killed():
    # PTRACE_PEEKDATA of a pid that does not exist: ESRCH (3) unconfined.
    assert probe(PTRACE, "--mdwe")[:2] == (0, "-1 3\n")
    rc, out, err = probe(PTRACE, "--unit", DEPLOY / "aerie-draft@.service")
    assert (rc, out) == (0, "-1 1\n"), err  # EPERM
    assert re.search(r"^run_confined: refused ptrace \(nr \d+\) to pid \d+; answered EPERM$", err, re.M), err
    rc, out, err = probe(PTRACE, "--filter", "@system-service", "--refuse", "kill")
    assert (rc, out) == (-signal.SIGKILL, ""), err
    assert re.search(r"^run_confined: refused ptrace \(nr \d+\) to pid \d+; killed it$", err, re.M), err


def test_fork_pipe_rlimits_prctl_kill_and_wait_pass_the_filter():
    # What the target's schema compiler in a child process does.
    code = ("import os, resource, signal, ctypes\n"
            "r, w = os.pipe()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    resource.setrlimit(resource.RLIMIT_AS, (1 << 34, 1 << 34))\n"
            "    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG\n"
            "    os.write(w, b'ready')\n"
            "    signal.pause()\n"
            "os.close(w)\n"
            "print(os.read(r, 5).decode(), resource.prlimit(pid, resource.RLIMIT_AS)[0] == 1 << 34)\n"
            "os.kill(pid, signal.SIGTERM)\n"
            "print(os.wait4(pid, 0)[1] == signal.SIGTERM)\n")
    rc, out, err = probe(code, "--unit", DEPLOY / "aerie-target@.service", "--refuse", "kill")
    assert (rc, out, REFUSED in err) == (0, "ready True\nTrue\n", False), err


def test_mdwe_survives_exec_and_refuses_writable_executable_memory():
    code = ("import ctypes, mmap\n"
            "print(ctypes.CDLL(None).prctl(66, 0, 0, 0, 0))  # PR_GET_MDWE\n"
            "try:\n"
            "    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
            "except PermissionError:\n"
            "    print('refused')\n")
    assert probe(code)[:2] == (0, "0\n")
    rc, out, err = probe(code, "--unit", DEPLOY / "aerie-gateway.service")
    assert (rc, out) == (0, "1\nrefused\n"), err
    assert "memory-deny-write-execute (PR_SET_MDWE)" in err and "umask 0007" in err


class Confined:
    """A release service binary, confined as its unit would be; its output
    in TMP/NAME.log."""

    def __init__(self, name, unit, args, tmp):
        self.name = name
        self.log_path = tmp / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(confined("--unit", DEPLOY / unit) + [str(ROOT / "build" / name), *map(str, args)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def text(self):
        return self.log_path.read_text()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=120)
        self.log.close()
        return rc


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model):
    have_seccomp()
    for b in ("aerie-draft", "aerie-target", "aerie-gateway"):
        if not (ROOT / "build" / b).exists():
            pytest.fail(f"build/{b} is missing: run `make all` first")
    tmp = tmp_path_factory.mktemp("confined")
    procs = []
    draft_addr, target_addr = f"unix:{tmp}/draft.sock", f"unix:{tmp}/target.sock"
    try:
        d = Confined("aerie-draft", "aerie-draft@.service",
                     ["--model", model, "--draft", HEAD, "--listen", draft_addr, "--max-seqs", "64",
                      "--max-seq-len", CTX, "--threads", "1"], tmp)
        procs.append(d)
        rpc.wait_for_socket(draft_addr, d.proc)
        t = Confined("aerie-target", "aerie-target@.service",
                     ["--model", model, "--listen", target_addr, "--draft-addr", draft_addr, "--no-spec-adaptive",
                      "--max-batch", "8", "--max-seq-len", CTX, "--threads", "1", "--draft-deadline-ms", "5000",
                      "--log-interval-s", "0"], tmp)
        procs.append(t)
        rpc.wait_for_socket(target_addr, t.proc)
        g = Confined("aerie-gateway", "aerie-gateway.service",
                     ["--model", model, "--targets", target_addr, "--port", "0", "--health-interval-ms", "200",
                      "--log-interval-s", "0"], tmp)
        procs.append(g)
        t0 = time.monotonic()
        while not (m := re.search(r"gateway_ready url=http://127\.0\.0\.1:(\d+)", g.text())):
            assert g.proc.poll() is None and time.monotonic() - t0 < 60, g.text()
            time.sleep(0.05)
        g.port = int(m.group(1))
        while request(g.port, "GET", "/health")[0] != 200:
            assert time.monotonic() - t0 < 60, g.text()[-2000:]
            time.sleep(0.05)
        g.client = openai.OpenAI(base_url=f"http://127.0.0.1:{g.port}/v1", api_key="unused", max_retries=0,
                                 timeout=300)
        g.sockets = (draft_addr[5:], target_addr[5:])
        g.procs = procs
        yield g
    finally:
        rcs = {p.name: p.stop() for p in reversed(procs)}
        logs = {p.name: p.text() for p in procs}
        refused = {n: [l for l in t.splitlines() if l.startswith(REFUSED)] for n, t in logs.items()}
        assert refused == {n: [] for n in logs}, "calls outside @system-service"
        assert rcs == {n: 0 for n in logs}, {n: logs[n][-2000:] for n in logs if rcs[n] != 0}


MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


def test_each_service_runs_confined_as_its_unit_says(stack):
    for p in stack.procs:
        head = p.text().splitlines()[0]
        assert head.startswith(f"run_confined: {p.name}: ") and " system calls allowed (@system-service), " \
            "others refused with EPERM and named here; umask 0007" in head, head
        assert ("memory-deny-write-execute" in head) == (p.name == "aerie-gateway"), head
    # UMask=0007: sockets the aerie group can connect to, nothing for others.
    for path in stack.sockets:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o770, oct(st.st_mode)


def test_plain_and_streamed_chat_are_plain_greedy_decoding(stack, model):
    r = subprocess.run([str(ROOT / "build" / "aerie"), "generate", "--model", str(model), "--chat", "--prompt",
                        json.dumps(MSGS), "--draft", "none", "--max-tokens", "24", "--threads", "1"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.endswith("\n"), r.stderr
    want = r.stdout[:-1]
    c = stack.client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=24, temperature=0)
    assert (c.choices[0].message.content, c.choices[0].finish_reason in ("stop", "length")) == (want, True)
    text, finish, usage, roles = stream_text(stack.client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert (text, finish, roles) == (want, c.choices[0].finish_reason, ["assistant"])
    assert usage.completion_tokens == c.usage.completion_tokens and usage.prompt_tokens == c.usage.prompt_tokens


def test_structured_output_compiles_and_constrains_under_the_filter(stack):
    msgs = [{"role": "user", "content": "List two colors as JSON."}]
    c = stack.client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=120, temperature=0,
                                             response_format={"type": "json_object"})
    assert c.choices[0].finish_reason == "stop", c.choices[0].message.content
    assert isinstance(json.loads(c.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    c = stack.client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Who are you?"}],
                                             max_tokens=120, temperature=0, response_format=fmt)
    assert c.choices[0].finish_reason == "stop", c.choices[0].message.content
    reply = json.loads(c.choices[0].message.content)
    jsonschema.validate(reply, schema)
    assert sorted(reply) == ["age", "name"]
    # A schema outside the subset is still refused by name, not by a crash.
    with pytest.raises(openai.BadRequestError) as ei:
        stack.client.chat.completions.create(
            model=MODEL_NAME, messages=msgs, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": {
                "type": "object", "oneOf": [{"type": "object"}]}}})
    assert ei.value.body["message"] == "'oneOf' at # is not supported"
