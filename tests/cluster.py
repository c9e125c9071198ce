"""Real daemons for the cluster and fault tests: a local MLflow tracking server,
a single-node SLURM (munge + slurmctld + slurmd on localhost), and helpers to
run Snakemake and the ``smallbatch`` CLI as subprocesses with hard timeouts.

Nothing here is a mock: the MLflow server is ``mlflow server`` with a SQLite
backend, SLURM is Debian's slurm-wlm configured by ``.ci/setup-slurm.sh``.
Every wait is for an event of the process waited on (its health endpoint answering,
its PID file, its exit, a file it writes) and is bounded only by a hang guard
(:data:`HANG_S`, or a test's own deadline), never by a short read: a loaded machine
answers late, not never.  Processes are started in their own session and stopped by
their own process-group id, never by name.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEFILE = REPO / "Snakefile"
SMOKE_CONFIG = REPO / "workflow" / "configs" / "smoke.yaml"
SLURM_PROFILE = REPO / "workflow" / "profiles" / "slurm" / "profile.yaml"
DEFAULT_PROFILE = REPO / "workflow" / "profiles" / "default"
SETUP_SLURM = REPO / ".ci" / "setup-slurm.sh"
BIN = Path(sys.executable).parent  # the venv's bin: python, smallbatch, mlflow, snakemake
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SLURM_MARK = "# written by smallbatch .ci/setup-slurm.sh"
#: The hang guard of one wait for another process's event (a daemon's answer, a PID file, an
#: exit): seconds a quiet machine needs, times far more than a machine loaded by six busy
#: processes beside the suite slows them.  Reaching it means a hang, not load.
HANG_S = 300.0


# --------------------------------------------------------------------------- basics
def as_foreground(argv: list) -> list:
    """``argv`` started as a terminal's foreground command is: SIGINT at its default, so Python
    turns it into KeyboardInterrupt.  A test run in the background of a shell without job
    control (``cmd &`` in a script) inherits SIGINT ignored, and an ignored SIGINT stays ignored
    across exec; the tests that send Ctrl-C start their command through this."""
    reset = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", reset, *(str(a) for a in argv)]


def env_with_venv(extra: dict | None = None) -> dict:
    """The environment for subprocesses: the venv's bin first on PATH (SLURM jobs
    inherit it through ``sbatch --export=ALL`` and run ``python -m snakemake``),
    one torch thread, no tqdm bars, no inherited tracking URI."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MLFLOW_TRACKING_URI", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("GIT_PYTHON_REFRESH", "quiet")
    if extra:
        env.update(extra)
    return env


#: The ports the tests' servers take (MLflow servers, gloo's rank 0): above the srun jobs'
#: 10000-29999 (smallbatch.training.distributed) and SLURM's daemons, below Linux's ephemeral
#: range (32768-60999 by default), so no outgoing connection holds one by chance.
PORTS = range(30000, 32768)
_next_port = 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, from this test process's own
    slice of :data:`PORTS`: pytest-xdist's workers (``PYTEST_XDIST_WORKER`` gw0, gw1, ...) take
    disjoint slices, so two tests that run at once never pick one port, and a server's health
    check can only reach the server it started.  Within a slice ports are taken in turn, so a
    port one test just closed is not handed to the next."""
    global _next_port
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    width = len(PORTS) // count
    first = PORTS.start + worker * width
    for _ in range(width):
        port = first + _next_port % width
        _next_port += 1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken (or closing): the next one
            return port
    raise RuntimeError(f"no free port in {first}-{first + width - 1}")


def wait_until(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    """Poll ``pred`` (an event: a file, a PID, an answer) until it holds; ``timeout`` is a hang guard."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
    """Stop a process started with ``start_new_session=True`` and all its children."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=grace)


def run(
    cmd: list[str],
    *,
    timeout: float,
    cwd: Path | None = None,
    env: dict | None = None,
    check: bool = False,
    log: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run a command with a hard timeout; on timeout its whole process group is killed
    and ``TimeoutError`` carries the output's tail.  With ``log`` the output is
    written there as it comes (and returned as ``stdout`` too)."""
    with open(log, "w") if log else contextlib.nullcontext() as fh:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env or env_with_venv(),
            stdout=fh or subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc, signal.SIGTERM, grace=10)
            out = Path(log).read_text() if log else (proc.stdout.read() if proc.stdout else "")
            msg = f"{' '.join(map(str, cmd[:6]))} ... ran over {timeout:.0f} s; output tail:\n{out[-3000:]}"
            raise TimeoutError(msg) from None
    if log:
        out = Path(log).read_text()
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {res.returncode}:\n{out[-4000:]}")
    return res


# --------------------------------------------------------------------------- processes
def descendants(pid: int) -> list[int]:
    """All descendant pids of ``pid`` (from /proc; Linux only)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def find_descendant(root: int, needle: str) -> int | None:
    """The pid of a Python process below ``root`` whose command line contains
    ``needle`` (not the shell that Snakemake wraps the command in)."""
    for p in descendants(root):
        argv = cmdline(p).split(" ")
        if Path(argv[0]).name.startswith("python") and needle in " ".join(argv):
            return p
    return None


def signal_pending(pid: int, sig: int) -> bool:
    """Whether signal ``sig`` waits to be handled by process ``pid`` (e.g. one sent to a stopped
    process), from /proc's SigPnd/ShdPnd masks; True once the process is gone."""
    try:
        status = (Path("/proc") / str(pid) / "status").read_text()
    except OSError:
        return True
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and (int(line.split()[1], 16) >> (sig - 1)) & 1:
            return True
    return not _pid_alive(pid)


# --------------------------------------------------------------------------- configs
def write_config(path: Path, base: Path | None = SMOKE_CONFIG, **overrides) -> Path:
    """A study config: ``base`` (the smoke study by default) updated by ``overrides``
    (top-level keys replaced; nested dicts merged one level)."""
    cfg = yaml.safe_load(base.read_text()) if base else {}
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def snakemake_cmd(workdir: Path, configfile: Path, profile: Path, *extra: str) -> list[str]:
    """``python -m snakemake`` on the repo's Snakefile, run in ``workdir`` (its own
    .snakemake/ folder), with ``configfile`` replacing config.yaml."""
    return [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(SNAKEFILE),
        "--directory",
        str(workdir),
        "--configfile",
        str(configfile),
        "--workflow-profile",
        str(profile),
        *extra,
    ]


def local_rules() -> set[str]:
    """Rules the workflow runs on the submitting host (``localrules:`` in workflow/rules)."""
    names: set[str] = {"all"}
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        text = smk.read_text()
        for m in re.finditer(r"^localrules:\s*\n((?:[ \t]+\w+,?\s*\n)+)", text, re.M):
            names.update(re.findall(r"\w+", m.group(1)))
        for m in re.finditer(r"^localrules:[ \t]*(\w[\w, \t]*)$", text, re.M):
            names.update(re.findall(r"\w+", m.group(1)))
    return names


def job_resources(dry: str) -> dict[str, list[str]]:
    """rule -> the `resources:` lines of its jobs in a dry run."""
    out: dict[str, list[str]] = {}
    rule = None
    for line in dry.splitlines():
        m = re.match(r"^\s*(?:local)?rule (\w+):", line)
        if m:
            rule = m.group(1)
        elif rule and line.strip().startswith("resources:"):
            out.setdefault(rule, []).append(line.strip())
    return out


def res_value(line: str, key: str) -> str | None:
    """The value of resource ``key`` in a dry run's `resources:` line (None: not asked for)."""
    m = re.search(rf"(?:^resources: |, ){key}=([^,]*)", line)
    return m.group(1) if m else None


def count_submissions(dry_run_output: str) -> dict[str, int]:
    """Jobs a cluster executor would submit, from ``snakemake -n`` output: one per
    group job, plus one per ungrouped job of a rule that is not local."""
    local = local_rules()
    groups = len(re.findall(r"^\[[^\]]+\] Group job ", dry_run_output, re.M))
    top = re.findall(r"^(?:local)?rule (\w+):", dry_run_output, re.M)  # group members are indented
    ungrouped = [r for r in top if r not in local]
    return {"group_jobs": groups, "single_jobs": len(ungrouped), "total": groups + len(ungrouped)}


# --------------------------------------------------------------------------- MLflow
class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with a SQLite backend and an artifact root.

    ``stop()`` and ``start()`` again keep the same port and store (the server
    "goes away" and "comes back").  ``artifacts``: the ``--artifacts-destination`` folder in
    ``root``; None leaves MLflow's default (``./mlartifacts``, in ``root``: ``mlflow ui`` as a
    user starts it in a study's results folder)."""

    def __init__(self, root: Path, port: int | None = None, workers: int = 1, artifacts: str | None = "artifacts"):
        self.root = Path(root)
        self.artifacts = artifacts
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.workers = workers
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "server.log"

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def backend(self) -> str:
        return f"sqlite:///{self.root / 'mlflow.db'}"

    def answers(self, wait_s: float) -> bool:
        """Whether the server answers its health endpoint: False at once while nothing listens
        (connection refused); a listening server gets ``wait_s`` to answer (a loaded one is slow)."""
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=max(wait_s, 1.0)) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def listening(self) -> bool:
        """Whether anything accepts connections on the server's port (no request is read)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def start(self, timeout: float = HANG_S) -> MlflowServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            str(self.workers),
            "--backend-store-uri",
            self.backend,
        ]
        if self.artifacts is not None:
            cmd += ["--artifacts-destination", str(self.root / self.artifacts)]
        with open(self.log, "ab") as log:
            # Without MLflow's job execution (on by default since 3.x: a job runner and six huey
            # consumers, each a Python process importing mlflow, per server start); the tracking
            # API these tests exercise is the same with or without it.
            env = env_with_venv({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
            self.proc = subprocess.Popen(
                cmd, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout

        def ready() -> bool:  # the event: its health endpoint answered, however late
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            return self.answers(deadline - time.monotonic())

        try:
            wait_until(ready, timeout, f"mlflow server on {self.uri}", interval=0.2)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            kill_group(self.proc, sig, grace=15)
            self.proc = None
        wait_until(lambda: not self.listening(), HANG_S, f"mlflow server on {self.uri} to close its port")

    @staticmethod
    def client_env(deadline_s: float) -> dict[str, str]:
        """MLflow's own deadline for a client of this server (a ``smallbatch`` job, the test's
        MlflowClient): each request may wait for its answer as long as the test may run.  The
        server answered its health check, so a slow answer is load (the product's 5 s read
        timeout failed four tests on a loaded machine); a hang still ends at the test's deadline.
        Refused connections (a stopped server) fail as fast as before: retries are left as set."""
        return {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(math.ceil(deadline_s))}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


@contextlib.contextmanager
def client_deadline(deadline_s: float):
    """This process's MLflow clients wait ``deadline_s`` for each answer inside the block
    (:meth:`MlflowServer.client_env`; the variables are restored after it)."""
    env = MlflowServer.client_env(deadline_s)
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mlflow_runs(uri: str, experiment: str) -> list:
    """All runs of ``experiment`` at ``uri`` (MLflow client, as the report reads them)."""
    from mlflow.tracking import MlflowClient

    with client_deadline(HANG_S):
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return []
        return client.search_runs([exp.experiment_id], max_results=10000)


# --------------------------------------------------------------------------- SLURM
class SlurmUnavailable(RuntimeError):
    """The local SLURM cannot be set up or started here (the reason is the message)."""


def _slurm_ok() -> bool:
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-n", "localhost", "-o", "%t"], capture_output=True, text=True, timeout=HANG_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip().rstrip("*~#") in ("idle", "mix", "alloc")


class LocalSlurm:
    """munged + slurmctld + slurmd on localhost, as configured by .ci/setup-slurm.sh.

    Started by the test session, stopped at its end (only the daemons this object
    started; a SLURM that was already up is used and left running)."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.started: list[tuple[str, Path]] = []  # (name, pid file)

    def _check_prerequisites(self) -> None:
        if sys.platform != "linux":
            raise SlurmUnavailable("the local SLURM needs Linux")
        if os.geteuid() != 0:
            raise SlurmUnavailable("starting munged/slurmctld/slurmd needs root")
        if SETUP_SLURM.exists():  # idempotent: installs only what is missing, rewrites only its own files
            r = subprocess.run(["bash", str(SETUP_SLURM)], capture_output=True, text=True, timeout=900)
            if r.returncode != 0:
                raise SlurmUnavailable(f".ci/setup-slurm.sh failed: {r.stderr.strip()[-500:]}")
        for exe in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol"):
            if not (shutil.which(exe) or Path("/usr/sbin", exe).exists()):
                raise SlurmUnavailable(f"{exe} is not installed (apt-get install slurm-wlm munge)")
        conf = Path("/etc/slurm/slurm.conf")
        if not conf.is_file() or SLURM_MARK not in conf.read_text().splitlines()[0]:
            raise SlurmUnavailable(f"{conf} was not written by .ci/setup-slurm.sh; not touching this machine's SLURM")

    @staticmethod
    def _sbin(name: str) -> str:
        return shutil.which(name) or f"/usr/sbin/{name}"

    def _munge_ok(self) -> bool:
        try:
            enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=HANG_S)
            if enc.returncode != 0:
                return False
            dec = subprocess.run(["unmunge"], input=enc.stdout, capture_output=True, timeout=HANG_S)
            return dec.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def start(self, timeout: float = HANG_S) -> LocalSlurm:
        self._check_prerequisites()
        if _slurm_ok():
            return self  # somebody's SLURM on this config is already up: use it, leave it
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self._munge_ok():
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            r = subprocess.run(
                ["runuser", "-u", "munge", "--", self._sbin("munged")], capture_output=True, text=True, timeout=HANG_S
            )
            if r.returncode != 0:
                raise SlurmUnavailable(f"munged did not start: {r.stderr.strip()[-300:]}")
            self.started.append(("munged", Path("/run/munge/munged.pid")))
            wait_until(self._munge_ok, HANG_S, "munged")
        for name, args in (("slurmctld", ["-c"]), ("slurmd", ["-N", "localhost"])):
            pidfile = Path(f"/run/{name}.pid")
            if pidfile.exists() and _pid_alive(_read_pid(pidfile)):
                continue
            r = subprocess.run([self._sbin(name), *args], capture_output=True, text=True, timeout=HANG_S)
            if r.returncode != 0:
                raise SlurmUnavailable(f"{name} did not start: {r.stderr.strip()[-300:]}")
            self.started.append((name, pidfile))
            # the event: the daemon has forked and written its PID file (slurm.conf names it)
            wait_until(lambda pidfile=pidfile: _pid_alive(_read_pid(pidfile)), HANG_S, f"{name}'s PID file {pidfile}")

        def node_up() -> bool:
            if _slurm_ok():
                return True
            state = subprocess.run(
                ["sinfo", "-h", "-n", "localhost", "-o", "%t"], capture_output=True, text=True, timeout=HANG_S
            ).stdout.strip()
            if state.startswith(("drain", "down")):
                subprocess.run(
                    ["scontrol", "update", "nodename=localhost", "state=resume"], capture_output=True, timeout=HANG_S
                )
            return False

        try:
            wait_until(node_up, timeout, "the SLURM node localhost to become idle", interval=1)
        except TimeoutError as exc:
            tail = ""
            for f in ("/var/log/slurm/slurmctld.log", "/var/log/slurm/slurmd.log"):
                if Path(f).exists():
                    tail += f"\n{f}:\n" + "\n".join(Path(f).read_text().splitlines()[-8:])
            self.stop()
            raise SlurmUnavailable(f"{exc}{tail}") from None
        return self

    def stop(self) -> None:
        for name, pidfile in reversed(self.started):
            pid = _read_pid(pidfile)
            if pid and _pid_alive(pid):
                os.kill(pid, signal.SIGTERM)
                try:
                    wait_until(lambda pid=pid: not _pid_alive(pid), HANG_S, f"{name} to stop")
                except TimeoutError:
                    os.kill(pid, signal.SIGKILL)
        self.started.clear()

    # -- queries ---------------------------------------------------------------
    @staticmethod
    def job(jobid: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (finished jobs stay visible MinJobAge = 3600 s)."""
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", str(jobid)], capture_output=True, text=True, timeout=HANG_S
        ).stdout
        fields = {}
        for tok in out.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                fields[k] = v
        return fields

    @staticmethod
    def cancel(jobids: list[str]) -> None:
        if jobids:
            subprocess.run(["scancel", *jobids], capture_output=True, timeout=HANG_S)


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(Path(pidfile).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def slurm_test_profile(dst: Path, logdir: Path, mem_mb: int = 1000) -> Path:
    """A copy of workflow/profiles/slurm for the single-node test SLURM.

    Changes only what this machine needs: the status command (no accounting
    here, so ``sacct`` would fail and Snakemake would wait forever), no account,
    a short first status check, memory requests that fit the node, and log
    folders under the test's tmp dir.  Groups, GPU requests and the rest are
    the real profile's."""
    prof = yaml.safe_load(SLURM_PROFILE.read_text())
    prof.update(
        {
            "slurm-status-command": "squeue",
            "slurm-no-account": True,
            "slurm-init-seconds-before-status-checks": 2,
            "slurm-logdir": str(logdir),
            "slurm-keep-successful-logs": True,
            "latency-wait": 10,
        }
    )
    prof["default-resources"]["mem_mb"] = mem_mb
    for res in prof.get("set-resources", {}).values():
        if "mem_mb" in res:
            res["mem_mb"] = mem_mb
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "profile.yaml").write_text(yaml.safe_dump(prof, sort_keys=False))
    return dst


def submitted_slurm_jobs(output: str) -> list[str]:
    """SLURM job ids from Snakemake's output ("... submitted with SLURM jobid N ...")."""
    return re.findall(r"submitted with SLURM jobid (\d+)", output)


def report_tables(report_dir: Path) -> dict[str, str]:
    """The CSV tables of a report, by file name."""
    return {p.name: p.read_text() for p in sorted((Path(report_dir) / "tables").glob("*.csv"))}


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


# --------------------------------------------------------------------------- once per session
_ONCE: dict[str, tuple[bool, object]] = {}
_BACKGROUND: dict[str, object] = {}


def once(key: str, fn: Callable[[], object]):
    """``fn()`` the first time ``key`` is asked for in this test session, its result
    (or its exception) every later time: shared by fixtures of several modules.
    If ``key`` was started with :func:`in_background`, wait for that instead."""
    if key not in _ONCE:
        fut = _BACKGROUND.pop(key, None)
        try:
            _ONCE[key] = (True, fut.result() if fut is not None else fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised for every caller
            _ONCE[key] = (False, exc)
    ok, val = _ONCE[key]
    if not ok:
        raise val  # type: ignore[misc]
    return val


def in_background(key: str, fn: Callable[[], object]) -> None:
    """Start ``fn()`` in a thread now; a later ``once(key, ...)`` waits for its result.
    (Two workflows that mostly wait, on SLURM's polling and on process start-up,
    overlap instead of queueing.)"""
    if key in _ONCE or key in _BACKGROUND:
        return
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=key)
    _BACKGROUND[key] = pool.submit(fn)
    pool.shutdown(wait=False)


def get_local_slurm(log_dir: Path) -> LocalSlurm:
    """The session's local SLURM (started on first use); SlurmUnavailable if it cannot run."""

    def start() -> LocalSlurm:
        s = LocalSlurm(log_dir)
        s.start()
        import atexit

        atexit.register(s.stop)  # also when pytest is interrupted
        return s

    return once("slurm", start)


def stop_local_slurm() -> None:
    ok, val = _ONCE.get("slurm", (False, None))
    if ok:
        val.stop()


def skip_or_fail(reason: str):
    """Without the daemons a cluster test cannot run: it fails where they must run (CI, or
    SMALLBATCH_REQUIRE_SLURM=1), else it skips with the reason -- never silently: pytest's
    -ra lists the reason and the run's last lines count the real-SLURM tests that ran and
    skipped (tests/conftest.py)."""
    import pytest

    if IN_CI or os.environ.get("SMALLBATCH_REQUIRE_SLURM", "") not in ("", "0"):
        pytest.fail(f"this run must test the real SLURM (CI or SMALLBATCH_REQUIRE_SLURM set) but: {reason}")
    pytest.skip(f"{reason} (SMALLBATCH_REQUIRE_SLURM=1 makes this a failure)")


def smoke_through_slurm(root: Path, slurm: LocalSlurm, timeout: float = 1500, background: bool = False) -> dict | None:
    """The smoke study submitted to the local SLURM through (a copy of) the slurm profile.
    Returns results dir, wall time, Snakemake's output and the SLURM job ids
    (``background=True``: starts it and returns None; a later call waits for it)."""

    def go() -> dict:
        root.mkdir(parents=True, exist_ok=True)
        # device auto on a cluster asks for GPUs (the node's stand-in GRES; torch trains on
        # its CPU); two cells per SLURM job, sharing one GPU
        cfg = write_config(root / "config.yaml", results_dir=str(root / "results"), device="auto", cells_per_gpu=2)
        prof = slurm_test_profile(root / "profile", logdir=root / "slurm_logs")
        env = env_with_venv({"SBATCH_PARTITION": "local"})
        env.pop("SBATCH_ACCOUNT", None)
        t0 = time.monotonic()
        try:
            res = run(
                snakemake_cmd(root, cfg, prof, "--group-components", "cell=2"),
                cwd=root,
                env=env,
                timeout=timeout,
                log=root / "snakemake.out",
            )
        except TimeoutError:
            slurm.cancel(submitted_slurm_jobs((root / "snakemake.out").read_text()))
            raise
        wall = time.monotonic() - t0
        return {
            "root": root,
            "results": root / "results",
            "config": cfg,
            "profile": prof,
            "rc": res.returncode,
            "output": res.stdout,
            "wall_s": wall,
            "jobids": submitted_slurm_jobs(res.stdout),
            "concurrent": background,
        }

    if background:
        in_background("smoke_slurm", go)
        return None
    return once("smoke_slurm", go)


def smoke_local(root: Path, tracking_uri: str | None = None, key: str = "smoke_local", timeout: float = 1500) -> dict:
    """The smoke study on local cores (``--cores 2``, the default profile, the console ``make study``
    shows: ``--logger smallbatch``); its jobs' requests to a
    ``tracking_uri`` server wait for their answers as long as the study may run."""

    def go() -> dict:
        root.mkdir(parents=True, exist_ok=True)
        over = {"results_dir": str(root / "results")}
        if tracking_uri:
            over["tracking_uri"] = tracking_uri
        cfg = write_config(root / "config.yaml", **over)
        t0 = time.monotonic()
        res = run(
            snakemake_cmd(root, cfg, DEFAULT_PROFILE, "--cores", "2", "--logger", "smallbatch"),
            cwd=root,
            env=env_with_venv(MlflowServer.client_env(timeout)),
            timeout=timeout,
            log=root / "snakemake.out",
        )
        wall = time.monotonic() - t0
        return {
            "root": root,
            "results": root / "results",
            "config": cfg,
            "rc": res.returncode,
            "output": res.stdout,
            "wall_s": wall,
        }

    return once(key, go)


#: `python -c PAUSED_PRETRAIN MARKER STEP <smallbatch args>`: a real `smallbatch` process (cli.main in
#: its own interpreter; each rank of a multi-process cell alike) that pauses after step STEP: it writes
#: MARKER, then blocks reading one byte from stdin.  A test signals it while it waits, so no race
#: decides where the signal lands.
PAUSED_PRETRAIN = """
import os, sys
from pathlib import Path
from smallbatch.pipeline import cli
from smallbatch.training import loop as train
marker, pause_at = Path(sys.argv[1]), int(sys.argv[2])
real_step = train.one_step
def one_step(t, idx, watch):
    out = real_step(t, idx, watch)
    if t.step == pause_at:
        marker.write_text(str(t.step))
        os.read(0, 1)  # until the test has signalled this process
    return out
train.one_step = one_step
sys.exit(cli.main(sys.argv[3:]))
"""
