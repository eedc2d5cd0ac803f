"""The whole serving stack for the tools under tools/: aerie-draft (when
asked for), aerie-target and aerie-gateway from one build directory, started
the way `make run` starts them (tools/run.sh): Unix sockets in a private
directory, each service's output in its own log file there, and only the
settings the caller names on top of the services' defaults. The gateway
listens on a free loopback port (--port 0; the port is read from its
gateway_ready line).

    stack = Stack(tmp, draft=True)        # raises StackError if a service fails to start
    ... http://127.0.0.1:{stack.port}/v1 ...
    codes = stack.stop()                  # {"gateway": 0, "target": 0, "draft": 0}
"""
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
import aerie_rpc as rpc  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD = ROOT / "build"


class StackError(RuntimeError):
    """A service did not start: the text names it, says how it ended and
    quotes its last log lines."""


class Stack:
    def __init__(self, tmp, draft, model=MODEL, build=BUILD, draft_args=(), target_args=(), gateway_args=(),
                 timeout=120):
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.model, self.build, self.timeout = model, Path(build), timeout
        self.draft_args = list(draft_args)
        # A stray AERIE_* in the caller's environment would change the
        # services' settings behind the caller's back.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
        self.draft_addr = f"unix:{self.tmp}/draft.sock" if draft else "none"
        self.target_addr = f"unix:{self.tmp}/target.sock"
        self.draft = self.target = self.gateway = None
        self.draft_starts = 0
        self.port = None
        try:
            if draft:
                self.start_draft()
            self.target = self._start("target", ["--listen", self.target_addr, "--draft-addr", self.draft_addr,
                                                 *target_args])
            self._wait_socket("target", self.target, self.target_addr)
            self.gateway = self._start("gateway", ["--targets", self.target_addr, "--port", 0, *gateway_args])
            self.port = self._gateway_port()
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def log(self, name):
        return self.tmp / f"{name}.log"

    def _start(self, name, args):
        with open(self.log(name), "a") as log:
            return subprocess.Popen([str(self.build / f"aerie-{name}"), "--model", str(self.model),
                                     *map(str, args)], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=self.env)

    def start_draft(self):
        """Starts aerie-draft (again, after a kill) and waits for its socket."""
        self.draft_starts += 1
        self.draft = self._start("draft", ["--listen", self.draft_addr, *self.draft_args])
        self._wait_socket("draft", self.draft, self.draft_addr)

    def _failed(self, name, how):
        lines = self.log(name).read_text(errors="replace").splitlines()
        tail = "\n".join("    " + line for line in lines[-10:])
        return StackError(f"aerie-{name} {how}; its last lines ({self.log(name)}):\n{tail}")

    def _check_alive(self, name, proc):
        if proc.poll() is not None:
            raise self._failed(name, f"exited with status {proc.returncode} while starting")

    def _wait_socket(self, name, proc, addr):
        try:
            rpc.wait_for_socket(addr, proc, self.timeout)
        except RuntimeError:
            self._check_alive(name, proc)
            raise
        except TimeoutError:
            raise self._failed(name, f"was not listening on {addr} after {self.timeout} s") from None

    def _gateway_port(self):
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.timeout:
            m = re.search(r"gateway_ready url=http://127\.0\.0\.1:(\d+)", self.log("gateway").read_text())
            if m:
                return int(m.group(1))
            self._check_alive("gateway", self.gateway)
            time.sleep(0.05)
        raise self._failed("gateway", f"printed no gateway_ready line after {self.timeout} s")

    def _wait_healthy(self):
        """Until /health answers 200: the gateway has seen its target ready."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.timeout:
            for name, proc in (("draft", self.draft), ("target", self.target), ("gateway", self.gateway)):
                if proc is not None:
                    self._check_alive(name, proc)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # 503 until the first health check has found the target
            time.sleep(0.1)
        raise self._failed("gateway", f"/health was not 200 after {self.timeout} s")

    def cpu_seconds(self):
        """CPU time (user and system) its services have used so far, in
        seconds: on a host whose speed moves with other tenants, the work
        done, beside the wall time it took. A service that has exited (or
        is not there) counts 0."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for proc in (self.draft, self.target, self.gateway):
            if proc is None:
                continue
            try:
                with open(f"/proc/{proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (stat fields 14 and 15)
        return total

    def stop(self):
        """SIGTERM to the gateway, then the target, then the draft, as
        `make run` stops them (each drains and exits); their exit statuses
        by name (a service killed after 120 s of draining: -9)."""
        codes = {}
        for name in ("gateway", "target", "draft"):
            proc = getattr(self, name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
            try:
                codes[name] = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes
