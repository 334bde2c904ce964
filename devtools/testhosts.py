"""Test hosts reachable over real SSH, for the launcher's multi-host tests.

A multi-host launcher goes through ``ssh`` (options, quoting, exit codes, connections that drop) and through
every machine's own network stack (which address a worker binds, whether the rendezvous address is reachable
from another machine). Replacing ssh with a local subprocess, or running every "host" on 127.0.0.1, hides
exactly those bugs. Here each host is a Linux network namespace with its own interface, address and sshd, and
the tests reach it with the real ssh client, so the multi-host tests are honest. The namespaces share the
filesystem (and the venv) with the test, like the machines of a cluster sharing an NFS home, but for their private
disks.

Private disks (``start_cluster(..., private=[paths])``, netns mode only): each host also gets a fresh tmpfs of its
own at every listed path, e.g. ``/dev/shm`` and a checkpoint store directory, mounted in the host's own mount
namespace (``ip netns exec`` makes one per sshd; everything started over SSH on the host inherits it). A file
written there on one host is seen neither by the other hosts nor by the test, and the test's own files there are
hidden from the hosts: a job that still works proves it needs no file system shared between machines. The mounts
never reach the test's namespace (``ip netns exec`` makes ``/`` a recursive slave of it, and each host makes it
one again before mounting), and they vanish with the host's last process.

Mode ``"netns"`` (root with CAP_SYS_ADMIN)::

    root namespace: <tag> 10.X.0.1 --veth-- [<tag>-sw: bridge br0] --veth-- eth0 10.X.0.2 in <tag>-h0 (sshd :22)
                                                                   --veth-- eth0 10.X.0.3 in <tag>-h1 (sshd :22)

The bridge lives in a namespace of its own (the "switch") rather than in the root namespace: bridged frames then
meet only that namespace's empty netfilter tables, so neither br_netfilter nor the machine's firewall (e.g.
Docker's FORWARD policy DROP) can filter host-to-host traffic, and no machine-wide sysctl has to change.

Mode ``"loopback"`` (when namespaces cannot be created, e.g. in an unprivileged container): one sshd on a free
port of the loopback aliases 127.0.0.2, 127.0.0.3, ...; the hosts then share the test's network stack.

Every namespace and interface is named ``vsh<pid>-<n>...`` (the pid of the creating process and a counter):
two clusters never clash, and :func:`cleanup_stale` recognises what a killed run left behind.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import functools
import itertools
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from devtools.procs import live_processes

__all__ = ["TestHost", "HostCluster", "start_cluster", "cleanup_stale"]

NETNS_ETC = Path("/etc/netns")
SSHD = "/usr/sbin/sshd"  # sshd re-executes itself, so it must be started by its absolute path
PREFIX = "vsh"
_STALE_NAME = re.compile(rf"^{PREFIX}(\d+)-\d+(?:-|$)")
_counter = itertools.count()
_READY_TIMEOUT = 20.0
_APT_TIMEOUT = 300.0
_PR_SET_PDEATHSIG = 1
_TMPFS_SIZE = re.compile(r"^[1-9]\d*[kmgKMG%]?$")  # what tmpfs's size= takes: bytes, k/m/g, or % of RAM


@dataclass
class TestHost:
    """One host: ``ssh -p PORT user@ADDRESS`` reaches it; ``netns`` is its namespace (None in loopback mode)."""

    __test__ = False  # not a pytest test class despite the name

    name: str
    address: str
    port: int
    netns: str | None


@dataclass
class HostCluster:
    """Hosts with their sshd running, a key that logs in to all of them and a known_hosts that vouches for them.

    ``manager_address`` is the test's own namespace as the hosts see it (where a launcher's rendezvous listens);
    ``tag`` starts the name of every namespace and interface of the cluster; ``private`` are the directories
    where each host has a tmpfs of its own (``private_size`` each), empty when the hosts share everything.
    """

    hosts: list[TestHost]
    user: str
    identity: Path
    known_hosts: Path
    manager_address: str
    mode: str
    tag: str
    workdir: Path
    private: tuple[Path, ...]
    private_size: str
    _teardown: _Teardown = field(repr=False)

    @property
    def daemons(self) -> list[subprocess.Popen]:
        """The sshd processes this cluster started."""
        return self._teardown.daemons

    def ssh_options(self) -> list[str]:
        return ["-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-i", str(self.identity), "-o", "IdentitiesOnly=yes",
                "-o", "ConnectTimeout=5"]

    def launcher_args(self) -> list[str]:
        """The ``varuna launch`` flags that reach these hosts: their key and known_hosts."""
        args = ["--ssh-identity", str(self.identity)]
        opts = self.ssh_options()
        for flag, value in zip(opts[::2], opts[1::2], strict=True):
            if flag == "-o":
                args += ["--ssh-option", value]
        return args

    def hosts_file_lines(self, slots: int) -> list[str]:
        """The hosts as lines of a launcher hosts file: ``user@address:port slots=N``."""
        return [f"{self.user}@{h.address}:{h.port} slots={slots}" for h in self.hosts]

    def run(self, host: TestHost, command: str, timeout: float = 20) -> subprocess.CompletedProcess:
        """Run the shell ``command`` on ``host`` over SSH; stdout and stderr are captured as text."""
        return subprocess.run(self._ssh_argv(host, command), stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=timeout)

    def copy_from(self, host: TestHost, remote: str | os.PathLike[str], local: Path, timeout: float = 60) -> Path:
        """Copy the directory ``remote`` of ``host`` (e.g. on its private disk) to ``local`` (tar over SSH)."""
        local.mkdir(parents=True, exist_ok=True)
        remote = Path(remote)
        packed = subprocess.run(self._ssh_argv(host, f"tar -C {shlex.quote(str(remote.parent))} -cf - "
                                                     f"{shlex.quote(remote.name)}"),
                                stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=True)
        subprocess.run(["tar", "-C", str(local), "-xf", "-"], input=packed.stdout, check=True, timeout=timeout)
        return local / remote.name

    def processes(self, needle: str) -> list[tuple[int, str]]:
        """``(pid, command line)`` of the live processes started over SSH on this cluster's hosts (descendants
        of its sshd daemons) whose command line contains ``needle`` — unlike a machine-wide ``pgrep``, blind to
        other tests' jobs running at the same time."""
        procs = live_processes()
        parents = {p.pid: p.ppid for p in procs}
        roots = {d.pid for d in self.daemons}

        def ours(pid: int) -> bool:
            for _ in range(64):
                pid = parents.get(pid, 0)
                if pid in roots:
                    return True
                if pid <= 1:
                    return False
            return False

        return [(p.pid, cmd) for p in procs if ours(p.pid) and needle in (cmd := p.cmdline())]

    def crash(self, host: TestHost) -> None:
        """The machine dies at once: SIGKILL to every process of the host, its sshd included (netns mode only: in
        loopback mode the hosts share one sshd and the test's processes). Its address stays: SSH to it is then
        refused, as by a machine whose sshd is not up (yet). What its private disks held is gone with it."""
        if host.netns is None:
            raise RuntimeError("crashing one host needs a network namespace per host (netns mode)")
        kill_namespace_processes(host.netns)
        for proc in self.daemons:
            if proc.poll() is None and _daemon_config(proc).stem == f"sshd-{host.name}":
                proc.wait(timeout=5)

    def boot(self, host: TestHost, replaced: dict[Path, Path] | None = None) -> None:
        """Start the sshd of a host that :meth:`crash` killed (the machine is back), and wait until it listens.

        The host's private disks are mounted again, empty: they were memory, as a rebooted machine's tmpfs (its
        /dev/shm, say) is, and a machine that comes back with nothing of its job on it is what a recovery meets.

        ``replaced`` maps files to the files whose content this host sees in their place (bind-mounted in the
        host's own mount namespace, which ``ip netns exec`` makes for it): a host whose copy of the code differs
        from the others', e.g. a deployment that did not finish."""
        if host.netns is None:
            raise RuntimeError("restarting one host needs a network namespace per host (netns mode)")
        config = self.workdir / f"sshd-{host.name}.conf"
        config.with_suffix(".pid").unlink(missing_ok=True)
        argv = _host_argv(config, _private_mounts(self.private, self.private_size, self.tag), replaced)
        proc = _spawn(["ip", "netns", "exec", host.netns, *argv], config.with_suffix(".log"))
        self._teardown.daemons.append(proc)
        _wait_for_pid_files([proc])

    def close(self) -> None:
        """Kill every process of the cluster and remove its namespaces and interfaces (idempotent, never raises).

        In loopback mode that is sshd alone: what the tests start over SSH runs in the test's own namespace.
        """
        self._teardown.close()

    def _ssh_argv(self, host: TestHost, command: str) -> list[str]:
        return ["ssh", *self.ssh_options(), "-p", str(host.port), f"{self.user}@{host.address}", command]


class _Teardown:
    """What a cluster created, recorded as soon as it exists, so that a failed start cleans up too."""

    def __init__(self) -> None:
        self.daemons: list[subprocess.Popen] = []
        self.namespaces: list[str] = []
        self.links: list[str] = []
        self._closed = False
        atexit.register(self.close)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for proc in self.daemons:
            proc.terminate()
        for ns in self.namespaces:  # sshd, and whatever the tests started over SSH
            kill_namespace_processes(ns)
        for proc in self.daemons:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for link in self.links:  # deleting one end of a veth pair deletes both, at once
            _ip("link", "delete", link, check=False)
        for ns in self.namespaces:
            _ip("netns", "delete", ns, check=False)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def start_cluster(n: int, workdir: Path, private: Sequence[str | os.PathLike[str]] = (),
                  private_size: str = "4g") -> HostCluster:
    """Start ``n`` hosts (``h0``, ``h1``, ...) with their keys, configs and logs in ``workdir``.

    Installs openssh-server and iproute2 if missing (RuntimeError if that fails). Uses network namespaces when
    it can, else the loopback aliases (``mode`` says which). Takes about a second; call ``close()`` when done
    (it also runs at exit).

    ``private``: absolute directories (created if missing; ``/dev/shm`` works too) where every host gets a
    fresh tmpfs of its own, with the directory's mode and owner and at most ``private_size`` (tmpfs's ``size=``:
    ``4g``, ``512m``, ``50%``; it takes only the memory its files use). Needs netns mode: RuntimeError where
    namespaces cannot be made, as loopback hosts share the test's mounts.
    """
    workdir = Path(workdir).resolve()
    private_paths = _private_paths(private, private_size, workdir)
    _ensure_tools()
    cleanup_stale()
    workdir.mkdir(parents=True, exist_ok=True)
    identity, host_key = workdir / "id_ed25519", workdir / "host_ed25519"
    _keygen(identity)
    _keygen(host_key)
    (workdir / "authorized_keys").write_text(identity.with_suffix(".pub").read_text())
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
    teardown = _Teardown()
    try:
        switch = _ip("netns", "add", f"{tag}-sw", check=False)
        if switch.returncode == 0:
            teardown.namespaces.append(f"{tag}-sw")
            mode = "netns"
            mounts = _private_mounts(private_paths, private_size, tag)
            hosts, manager_address = _start_netns_hosts(n, tag, workdir, mounts, teardown)
        elif private_paths:
            raise RuntimeError("private disks need a mount namespace per host, and network namespaces cannot be "
                               f"created here (`ip netns add`: {switch.stderr.strip()}); loopback hosts share "
                               "every mount with the test")
        else:
            mode = "loopback"
            hosts, manager_address = _start_loopback_hosts(n, workdir, teardown)
        cluster = HostCluster(hosts=hosts, user=pwd.getpwuid(os.geteuid()).pw_name, identity=identity,
                              known_hosts=workdir / "known_hosts", manager_address=manager_address, mode=mode,
                              tag=tag, workdir=workdir, private=private_paths, private_size=private_size,
                              _teardown=teardown)
        _wait_for_pid_files(teardown.daemons)
        pubkey = host_key.with_suffix(".pub").read_text().split()
        cluster.known_hosts.write_text("".join(
            f"{a if p == 22 else f'[{a}]:{p}'} {pubkey[0]} {pubkey[1]}\n"
            for a, p in sorted({(h.address, h.port) for h in hosts})))
        _check_logins(cluster)
    except BaseException:
        teardown.close()
        raise
    return cluster


def cleanup_stale() -> None:
    """Remove the namespaces (with their processes) and interfaces of clusters whose creating process is dead."""
    for link in _link_names():
        if _is_stale(link):
            _ip("link", "delete", link, check=False)
    for ns in _netns_names():
        if _is_stale(ns):
            kill_namespace_processes(ns)
            _ip("netns", "delete", ns, check=False)
    for entry in NETNS_ETC.glob(f"{PREFIX}*") if NETNS_ETC.is_dir() else []:
        if _is_stale(entry.name):
            shutil.rmtree(entry, ignore_errors=True)


def _no_dns(ns: str) -> None:
    """Give the namespace a resolv.conf that fails at once (``ip netns exec`` mounts /etc/netns/NS/* over
    /etc). The machine's name server is not reachable from the test network: every lookup (c10d resolves the
    peers of its store) would otherwise wait for DNS timeouts, seconds each."""
    (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
    (NETNS_ETC / ns / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


def _private_paths(private: Sequence[str | os.PathLike[str]], size: str, workdir: Path) -> tuple[Path, ...]:
    """The private directories, checked before anything starts: absolute, not ``/``, not a file, and not above
    the cluster's ``workdir`` (the tmpfs would hide sshd's config and keys from it)."""
    if isinstance(private, (str, os.PathLike)):
        raise TypeError(f"private takes a sequence of paths, not one path: {private!r}")
    if not _TMPFS_SIZE.match(size):
        raise ValueError(f"private_size must be a tmpfs size such as 4g, 512m or 50%, got {size!r}")
    paths: list[Path] = []
    for entry in private:
        path = Path(entry)
        if not path.is_absolute():
            raise ValueError(f"a private directory must be an absolute path, got {str(entry)!r}")
        path = path.resolve()  # what mount resolves too (/dev/shm may be a link to /run/shm)
        if path == Path("/") or workdir.is_relative_to(path):
            raise ValueError(f"a private directory must not hide the cluster's workdir {workdir}: {path}")
        if path.exists() and not path.is_dir():
            raise ValueError(f"a private directory must be a directory: {path} is not")
        if path not in paths:
            paths.append(path)
    return tuple(paths)


def _private_mounts(paths: tuple[Path, ...], size: str, tag: str) -> list[str]:
    """Shell commands that mount a fresh tmpfs at each path, each with the mode and owner the directory has in
    the test's namespace (created there first; ``mkdir -p`` again for a path inside another private one). The
    tmpfs is named ``<tag>-private``, so that ``/proc/*/mountinfo`` tells whose it is."""
    if not paths:
        return []
    commands = ["mount --make-rslave /"]  # as ip netns exec leaves it: nothing mounted here propagates back
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)
        st = path.stat()
        options = f"size={size},mode={st.st_mode & 0o7777:o},uid={st.st_uid},gid={st.st_gid}"
        quoted = shlex.quote(str(path))
        commands.append(f"mkdir -p {quoted} && mount -t tmpfs -o {shlex.quote(options)} {tag}-private {quoted}")
    return commands


def _host_argv(config: Path, mounts: list[str], replaced: dict[Path, Path] | None = None) -> list[str]:
    """The argv, run in a host's network namespace, that makes ``mounts`` (shell commands) and bind-mounts the
    ``replaced`` files in the host's mount namespace, then becomes its sshd (the config stays the last word)."""
    argv = [SSHD, "-D", "-e", "-f", str(config)]
    mounts = mounts + [f"mount --bind {shlex.quote(str(new))} {shlex.quote(str(old))}"
                       for old, new in (replaced or {}).items()]
    if not mounts:
        return argv
    return ["sh", "-c", " && ".join(mounts) + ' && exec "$@"', "sh", *argv]


def _start_netns_hosts(n: int, tag: str, workdir: Path, mounts: list[str],
                       teardown: _Teardown) -> tuple[list[TestHost], str]:
    switch = f"{tag}-sw"
    _ip("-n", switch, "link", "add", "name", "br0", "type", "bridge")
    _ip("-n", switch, "link", "set", "br0", "up")
    # Choosing the subnet and taking it must not interleave with another cluster doing the same.
    with open(Path(tempfile.gettempdir()) / "varuna-sshhosts.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subnet = _free_subnet()
        _ip("link", "add", "name", tag, "type", "veth", "peer", "name", "uplink", "netns", switch)
        teardown.links.append(tag)
        _ip("addr", "add", f"{subnet}.1/24", "dev", tag)
    _ip("link", "set", tag, "up")
    _ip("-n", switch, "link", "set", "uplink", "master", "br0", "up")
    hosts = []
    for i in range(n):
        ns, address = f"{tag}-h{i}", f"{subnet}.{i + 2}"
        _ip("netns", "add", ns)
        teardown.namespaces.append(ns)
        _no_dns(ns)
        _ip("link", "add", "name", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", switch)
        _ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", f"{subnet}.1")
        _start_sshd(workdir, f"h{i}", [f"{address}:22"], ns, teardown, mounts)
        hosts.append(TestHost(f"h{i}", address, 22, ns))
    return hosts, f"{subnet}.1"


def _start_loopback_hosts(n: int, workdir: Path, teardown: _Teardown) -> tuple[list[TestHost], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addresses = [f"127.0.0.{i + 2}" for i in range(n)]
    _start_sshd(workdir, "loopback", [f"{a}:{port}" for a in addresses], None, teardown)
    return [TestHost(f"h{i}", a, port, None) for i, a in enumerate(addresses)], "127.0.0.1"


def _start_sshd(workdir: Path, name: str, listen: list[str], netns: str | None, teardown: _Teardown,
                mounts: list[str] | None = None) -> None:
    """Start ``sshd -D`` (in ``netns`` if given, after the shell commands ``mounts`` ran in its mount namespace)
    on the ``addr:port`` in ``listen``.

    Its files are ``workdir/sshd-NAME.conf``, ``.pid`` and ``.log``; the config is the last word of its argv.
    """
    config = workdir / f"sshd-{name}.conf"
    config.with_suffix(".pid").unlink(missing_ok=True)  # from an earlier cluster in this workdir
    config.write_text(_sshd_config(workdir, config.with_suffix(".pid"), listen))
    argv = _host_argv(config, mounts or [])
    teardown.daemons.append(_spawn(["ip", "netns", "exec", netns, *argv] if netns else argv,
                                   config.with_suffix(".log")))


def _sshd_config(workdir: Path, pid_file: Path, listen: list[str]) -> str:
    lines = [f"ListenAddress {a}" for a in listen] + [
        f"HostKey {workdir / 'host_ed25519'}",
        f"AuthorizedKeysFile {workdir / 'authorized_keys'}",
        f"PidFile {pid_file}",
        "StrictModes no", "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "PrintMotd no", "LogLevel ERROR",
        # A launcher opens several connections at once; the default (10) starts refusing some at random.
        "MaxStartups 100",
    ]
    if _openssh_version() >= (9, 8):
        # From 9.8 sshd locks out a source address after connections it counts as misbehaving; the tests
        # kill connections on purpose, always from the same address.
        lines.append("PerSourcePenalties no")
    return "\n".join(lines) + "\n"


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    """Start a daemon that gets SIGTERM if this process dies without closing the cluster (e.g. SIGKILL)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM))


def _daemon_config(proc: subprocess.Popen) -> Path:
    """The config file of an sshd this module started (the last word of its argv)."""
    return Path(proc.args[-1])


def _wait_for_pid_files(daemons: list[subprocess.Popen]) -> None:
    """sshd writes its pid file once it listens on every address: wait for all of them."""
    deadline = time.monotonic() + _READY_TIMEOUT
    for proc in daemons:
        config = _daemon_config(proc)
        while not config.with_suffix(".pid").exists():
            if proc.poll() is not None:
                log = config.with_suffix(".log").read_text()
                raise RuntimeError(f"sshd exited with {proc.returncode} ({' '.join(proc.args)}):\n{log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not start within {_READY_TIMEOUT:.0f}s ({' '.join(proc.args)})")
            time.sleep(0.01)


def _check_logins(cluster: HostCluster) -> None:
    """Log in to every host at once as a launcher would (BatchMode, StrictHostKeyChecking=yes)."""
    procs = [subprocess.Popen(cluster._ssh_argv(h, "true"), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for h in cluster.hosts]
    failures = []
    for host, proc in zip(cluster.hosts, procs, strict=True):
        try:
            _, err = proc.communicate(timeout=_READY_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            failures.append(f"{host.name} ({host.address}:{host.port}): {err.strip() or f'exit {proc.returncode}'}")
    if failures:
        raise RuntimeError("ssh login failed on " + "; ".join(failures))


def _ensure_tools() -> None:
    """Install openssh-server (with the client) and iproute2 if sshd, ssh, ssh-keygen or ip is missing."""
    if _tools_present():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update"],
                 ["apt-get", "-o", "DPkg::Lock::Timeout=60", "install", "-y", "openssh-server", "iproute2"]):
        try:
            subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True,
                           timeout=_APT_TIMEOUT)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"the SSH test hosts need openssh-server and iproute2; `{' '.join(argv)}` failed "
                               f"with exit {e.returncode}:\n{e.stderr.strip()}") from e
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"the SSH test hosts need openssh-server and iproute2; `{' '.join(argv)}` "
                               f"failed: {e}") from e
    if not _tools_present():
        raise RuntimeError("the SSH test hosts need sshd, ssh, ssh-keygen and ip: still missing after apt-get")


def _tools_present() -> bool:
    return os.access(SSHD, os.X_OK) and all(shutil.which(t) for t in ("ssh", "ssh-keygen", "ip"))


@functools.cache
def _openssh_version() -> tuple[int, int]:
    banner = subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr  # "OpenSSH_9.2p1 Debian..."
    match = re.search(r"OpenSSH_(\d+)\.(\d+)", banner)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _keygen(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.with_suffix(".pub").unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "varuna-test", "-f", str(path)],
                   stdin=subprocess.DEVNULL, capture_output=True, check=True)


def _free_subnet() -> str:
    """``10.X.0`` with no address or route of this machine in 10.X.0.0/16."""
    used = {int(x) for x in re.findall(r"\b10\.(\d+)\.",
                                       _ip("-o", "addr", "show").stdout + _ip("route", "show").stdout)}
    for x in range(254, 0, -1):
        if x not in used:
            return f"10.{x}.0"
    raise RuntimeError("no free 10.X.0.0/24 subnet for the SSH test hosts")


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process in the namespace until none is left (a dying process may still fork)."""
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _is_stale(name: str) -> bool:
    """Whether ``name`` is one of ours and the process that created it is gone."""
    match = _STALE_NAME.match(name)
    if not match:
        return False
    try:
        os.kill(int(match[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        pass
    return False


def _link_names() -> list[str]:
    # "5: vsh123-0@if2: <BROADCAST,...> ..."
    return [line.split(": ")[1].split("@")[0] for line in _ip("-o", "link", "show", check=False).stdout.splitlines()]


def _netns_names() -> list[str]:
    # "vsh123-0-h1 (id: 2)"
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc
