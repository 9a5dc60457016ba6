"""A real `vllm serve` on loopback, for the tests and scripts that claim a server.

    with Server(model, "--kv-eviction", "h2o", "--kv-budget", "64") as srv:
        requests.post(srv.url + "/v1/completions", json={...})

The server runs as a child process in its own process group (its engine core
and any workers are its children), with the small fixed KV pool and eager mode
the rest of the suite uses. `stock=True` starts it with our plugin not loaded
at all (VLLM_PLUGINS=""), which is stock vLLM. Leaving the block kills the whole
group; `log()` returns what the server printed, for assertion messages.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import requests

from vllm_kvevict.models import native_dtype


def kv_pool_bytes(dtype: str) -> int:
    """The suite's small KV pool: 96 MiB of bf16, the same number of blocks in fp32."""
    return (96 << 20) * (2 if dtype == "float32" else 1)


_DTYPE = native_dtype()
DEFAULT_ARGS = ("--enforce-eager", "--block-size", "32", "--max-model-len", "2048",
                "--kv-cache-memory-bytes", str(kv_pool_bytes(_DTYPE)), "--dtype", _DTYPE,
                "--seed", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_processes(sid: int) -> list:
    """The live (not zombie) processes of session `sid` as psutil processes,
    those whose parent died included (they keep the session)."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


class Server:
    def __init__(self, model: str, *args: str, stock: bool = False, env: dict | None = None,
                 start_timeout: float = 600.0, defaults: tuple[str, ...] = DEFAULT_ARGS):
        # start_timeout: a server that exits fails at once; 600 s only bounds a hang. A
        # cold start (fresh venv, both cores busy with the suite) once took over 300 s.
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
                     "--host", "127.0.0.1", "--port", str(self.port), *defaults, *args]
        self.env = dict(os.environ)
        # The test process runs the engine core in-process; a server must not.
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        # Its own eviction-metrics directory, not this process's.
        self.env.pop("KVEVICT_METRICS_DIR", None)
        if stock:
            self.env["VLLM_PLUGINS"] = ""
        self.env.update(env or {})
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log")

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-4000:]}")
            if self.healthy():
                return
            time.sleep(0.2)  # a refused connection costs nothing; a late one idles the caller
        self.stop()
        raise TimeoutError(f"vllm serve not healthy after {self.start_timeout}s:\n"
                           f"{self.log()[-4000:]}")

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def processes(self) -> list:
        """The live (not zombie) processes of this server's session, as psutil
        processes: the API server, its engine core, workers and helpers, and any
        of them left behind after their parent died (they keep the session)."""
        return session_processes(self.proc.pid) if self.proc else []

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is not None:  # exited; its engine core or workers may not have
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return

    def log(self) -> str:
        self._log.flush()
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {sample name with labels: value} (Prometheus text format).
        A sample named twice (the same labels) is an error: Prometheus rejects
        such a scrape's duplicates, and a dict would hide one of them."""
        text = requests.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                if name in out:
                    raise AssertionError(f"/metrics has {name} twice")
                out[name] = float(value)
        return out

    def metric(self, name: str) -> float:
        """Sum of the samples called `name`: over all labels for a bare name
        (`vllm:num_requests_running`), or the one sample for a name with labels
        (`vllm_kvevict_resident_tokens{kind="logical"}`)."""
        if "{" in name:
            return self.metrics().get(name, 0.0)
        return sum(v for k, v in self.metrics().items() if k.split("{")[0] == name)

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Poll `/metrics` until vLLM reports no request running or waiting and
        `vllm:kv_cache_usage_perc` 0 (every KV block back in its pool), or
        `timeout` passes; returns the last scrape either way (callers assert)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()

            def total(name):
                return sum(v for k, v in m.items() if k.split("{")[0] == name)

            if (total("vllm:num_requests_running") == 0 and total("vllm:num_requests_waiting") == 0
                    and total("vllm:kv_cache_usage_perc") == 0) or time.monotonic() > deadline:
                return m
            time.sleep(0.5)

    def complete(self, prompt: str, **body) -> requests.Response:
        body = {"model": self.model, "prompt": prompt, "temperature": 0, **body}
        return requests.post(self.url + "/v1/completions", json=body, timeout=300)
