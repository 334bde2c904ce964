"""A real one-node Slurm cluster on this machine, for the launcher's Slurm tests: its own munged (a fresh key, its
own socket), slurmctld and slurmd, on free ports, with every file in a work directory, configured with
``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` (no cgroups needed).

Debian's ``slurm-wlm`` and ``munge`` are installed with apt-get if missing, as the SSH test hosts install sshd.
:func:`start_slurm` raises :class:`SlurmUnavailable` with the reason when a cluster cannot run here (not root,
no package, daemons that do not come up); the tests skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from devtools.procs import live_processes

__all__ = ["SlurmCluster", "SlurmUnavailable", "start_slurm"]

_DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel", "srun")


class SlurmUnavailable(RuntimeError):
    """No Slurm cluster can run on this machine (the message says why)."""


class SlurmCluster:
    """The running cluster: ``env`` points Slurm's commands at it (``SLURM_CONF``)."""

    def __init__(self, workdir: Path, node: str) -> None:
        self.workdir, self.node = workdir, node
        self.conf = workdir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.daemons: list[subprocess.Popen] = []
        self.munged_pid: Path = workdir / "munge" / "pid"

    def run(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(list(argv), env=self.env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
        return done

    def sbatch(self, script: Path, *options: str, env: dict[str, str] | None = None) -> str:
        """Submit ``script``; its job id."""
        done = subprocess.run(["sbatch", "--parsable", *options, str(script)], env={**self.env, **(env or {})},
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch: {done.stderr.strip()[-500:]}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            state = self.job(job_id).get("JobState", "")
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is {state}, not one of {sorted(states)}, after {timeout:g}s")
            time.sleep(0.3)

    def diagnose(self, job_id: str) -> str:
        """What a failing test shows: the job's state and reason, the node's, and the daemons' last log lines."""
        job = self.job(job_id)
        node = self.run("sinfo", "-h", "-N", "-o", "%N %T %E", check=False).stdout.strip()
        return (f"job {job_id}: {job.get('JobState')} ({job.get('Reason')}), exit {job.get('ExitCode')}, "
                f"restarts {job.get('Restarts')}; node: {node}; logs: {_tail(self.workdir / 'log')}")


    def close(self) -> None:
        """Cancel every job, stop the daemons, and kill whatever is left of the cluster: a job step's slurmstepd
        and tasks outlive slurmd (they carry this cluster's SLURM_CONF in their environment)."""
        self.run("scancel", "--full", "--user", "root", check=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
            time.sleep(0.2)
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.daemons:
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        needle = f"SLURM_CONF={self.conf}".encode()
        for proc in live_processes():
            if proc.pid != os.getpid() and needle in proc.environ():
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except OSError:
                    continue
        try:
            os.kill(int(self.munged_pid.read_text().strip()), signal.SIGTERM)
        except (OSError, ValueError):
            pass


def start_slurm(workdir: Path) -> SlurmCluster:
    """A one-node cluster whose node is this machine, with CPUs for two one-CPU tasks."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("the test cluster's daemons run as root: not root here")
    _ensure_tools()
    node = socket.gethostname().split(".")[0]
    try:
        socket.getaddrinfo(node, None)
    except OSError:
        raise SlurmUnavailable(f"this machine's name {node!r} does not resolve") from None
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = SlurmCluster(workdir, node)
    try:
        _start_munge(workdir / "munge")
        for sub in ("state", "spool", "log"):
            (workdir / sub).mkdir(exist_ok=True)
        cluster.conf.write_text(_config(workdir, node, _free_port(), _free_port()))
        with open(workdir / "log" / "daemons.out", "ab") as log:  # the daemons write to their own copies
            for argv in (["slurmctld", "-D", "-i", "-f", str(cluster.conf)],
                         ["slurmd", "-D", "-N", node, "-f", str(cluster.conf)]):
                cluster.daemons.append(subprocess.Popen(argv, env=cluster.env, stdin=subprocess.DEVNULL, stdout=log,
                                                        stderr=subprocess.STDOUT, start_new_session=True))
        _wait_idle(cluster)
    except BaseException:
        cluster.close()
        raise
    return cluster


def _wait_idle(cluster: SlurmCluster, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        for proc in cluster.daemons:
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{proc.args[0]} exited with {proc.returncode}: "
                                       f"{_tail(cluster.workdir / 'log')}")
        done = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=10)
        state = done.stdout.strip()
        if done.returncode == 0 and state.startswith("idle"):
            return
        time.sleep(0.3)
    raise SlurmUnavailable(f"the test node is {state or 'not known'} after {timeout:g}s: "
                           f"{_tail(cluster.workdir / 'log')}")


def _tail(log_dir: Path) -> str:
    lines = []
    for path in sorted(log_dir.glob("*")):
        lines += [f"{path.name}: {x}" for x in path.read_text(errors="replace").splitlines()[-3:]]
    return " | ".join(lines)[-1500:]


def _config(workdir: Path, node: str, ctld_port: int, slurmd_port: int) -> str:
    cpus = max(2, os.cpu_count() or 1)
    return f"""\
ClusterName=varunatest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds before it may start again (the node refuses it sooner: "credential
# revoked"); Slurm's default is 120 s, and its scheduler looks at pending jobs every 60 s by default
AuthInfo=socket={workdir}/munge/sock,cred_expire=5
CredType=cred/munge
StateSaveLocation={workdir}/state
SlurmdSpoolDir={workdir}/spool
SlurmctldPidFile={workdir}/slurmctld.pid
SlurmdPidFile={workdir}/slurmd.pid
SlurmctldLogFile={workdir}/log/slurmctld.log
SlurmdLogFile={workdir}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=30
MinJobAge=600
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def _start_munge(directory: Path) -> None:
    directory.mkdir(mode=0o700, exist_ok=True)
    key = directory / "key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
    done = subprocess.run(["munged", "--force", f"--socket={directory}/sock", f"--key-file={key}",
                           f"--log-file={directory}/log", f"--pid-file={directory}/pid",
                           f"--seed-file={directory}/seed"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=30)
    if done.returncode != 0:
        raise SlurmUnavailable(f"munged did not start: {done.stderr.strip()[-300:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_tools() -> None:
    if all(shutil.which(t) for t in _DAEMONS):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update"],
                 ["apt-get", "-o", "DPkg::Lock::Timeout=60", "install", "-y", "slurm-wlm", "munge"]):
        try:
            subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True,
                           timeout=900)
        except (OSError, subprocess.SubprocessError) as exc:
            raise SlurmUnavailable(f"cannot install slurm-wlm and munge ({' '.join(argv[:2])}): {exc}") from None
    missing = [t for t in _DAEMONS if not shutil.which(t)]
    if missing:
        raise SlurmUnavailable(f"still missing after apt-get install slurm-wlm munge: {', '.join(missing)}")
