"""Smoke test of the SSH test hosts: logins, the venv on every host, host-to-host and host-to-manager TCP, and a
teardown that leaves no namespace, interface or sshd behind; the hosts' private disks (a tmpfs per host that no
other host and not the test sees, empty again after a reboot, gone after the teardown)."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import testhosts
from devtools.testhosts import HostCluster, TestHost, start_cluster

SHM = Path("/dev/shm")


def _connect(address: str, port: int) -> str:
    """A shell command that opens a TCP connection to ``address:port`` with the venv's Python."""
    code = f"import socket; socket.create_connection(({address!r}, {port}), 3).close()"
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


@pytest.mark.timeout(120)
def test_two_hosts_over_ssh(tmp_path) -> None:
    cluster = start_cluster(2, tmp_path)
    try:
        assert [h.name for h in cluster.hosts] == ["h0", "h1"]
        assert len({(h.address, h.port) for h in cluster.hosts}) == 2
        h0 = cluster.hosts[0]
        assert cluster.hosts_file_lines(2)[0] == f"{cluster.user}@{h0.address}:{h0.port} slots=2"
        with socket.create_server((cluster.manager_address, 0)) as manager:
            manager_port = manager.getsockname()[1]
            for host, other in zip(cluster.hosts, reversed(cluster.hosts), strict=True):
                if cluster.mode == "netns":
                    addrs = cluster.run(host, "ip -o -4 addr show")
                    assert addrs.returncode == 0, addrs.stderr
                    assert f" {host.address}/" in addrs.stdout
                    assert other.address not in addrs.stdout  # a network stack of its own
                imports = cluster.run(host, f"{shlex.quote(sys.executable)} -c 'import varuna_core, torch'", timeout=60)
                assert imports.returncode == 0, imports.stderr
                for address, port in ((other.address, other.port), (cluster.manager_address, manager_port)):
                    reach = cluster.run(host, _connect(address, port))
                    assert reach.returncode == 0, f"{host.name} -> {address}:{port}: {reach.stderr}"
    finally:
        cluster.close()
    cluster.close()  # idempotent
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert cluster.tag not in netns
    assert cluster.tag not in links
    assert cluster.daemons and all(proc.poll() is not None for proc in cluster.daemons)


def _file_on(cluster: HostCluster, host: TestHost, path: Path) -> str | None:
    """The content of ``path`` as ``host`` sees it, None where it has no such file."""
    quoted = shlex.quote(str(path))
    probe = cluster.run(host, f"if test -e {quoted}; then cat {quoted}; else echo absent; fi")
    assert probe.returncode == 0, probe.stderr
    return None if probe.stdout == "absent\n" else probe.stdout


def _write_on(cluster: HostCluster, host: TestHost, path: Path, text: str) -> None:
    wrote = cluster.run(host, f"echo {shlex.quote(text)} > {shlex.quote(str(path))}")
    assert wrote.returncode == 0, wrote.stderr


def _private_mount_points(mountinfo: str, cluster: HostCluster) -> set[str]:
    """The mount points, in a ``/proc/PID/mountinfo`` text, of the tmpfs this cluster mounts on its hosts."""
    points = set()
    for line in mountinfo.splitlines():  # "ID PARENT DEV ROOT MOUNT_POINT OPTIONS [TAGS] - TYPE SOURCE OPTIONS"
        before, _, after = line.partition(" - ")
        if after.split()[:2] == ["tmpfs", f"{cluster.tag}-private"]:
            points.add(before.split()[4])
    return points


def _own_mounts_under(*directories: Path) -> list[str]:
    """The test's own mounts (its mount namespace) at or below ``directories`` (other clusters, of other tests,
    add and remove theirs under /run/netns meanwhile)."""
    lines = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = Path(line.split()[4])
        if any(point == d or d in point.parents for d in directories):
            lines.append(line)
    return lines


def _private_mounts_anywhere(cluster: HostCluster) -> set[str]:
    """Where any process of this machine, in whatever mount namespace, sees one of the cluster's private tmpfs."""
    points: set[str] = set()
    for mountinfo in Path("/proc").glob("[0-9]*/mountinfo"):
        try:
            points |= _private_mount_points(mountinfo.read_text(), cluster)
        except OSError:  # the process has ended
            pass
    return points


@pytest.mark.timeout(120)
def test_each_host_has_private_disks_that_neither_the_others_nor_the_test_see(tmp_path) -> None:
    """A file written in a private directory (a store directory, /dev/shm) on one host is on that host alone; the
    test's own /dev/shm is hidden from the hosts and left as it was; nothing is mounted in the test's namespace,
    during or after the cluster's life."""
    store = tmp_path / "store"  # missing: start_cluster creates it
    own = SHM / f"varuna-sshhosts-{os.getpid()}-{tmp_path.name}"  # the test's (the launcher's) own shared memory
    own.write_text("launcher\n")
    mounts_before = _own_mounts_under(store, SHM)
    assert mounts_before  # /dev/shm itself
    cluster = start_cluster(2, tmp_path / "hosts", private=(store, "/dev/shm"), private_size="64m")
    try:
        h0, h1 = cluster.hosts
        assert cluster.mode == "netns"
        assert cluster.private == (store.resolve(), SHM.resolve())
        assert store.is_dir()
        for host in (h0, h1):
            seen = _private_mount_points(cluster.run(host, "cat /proc/self/mountinfo").stdout, cluster)
            assert seen == {str(store.resolve()), str(SHM.resolve())}
        for directory in (store, SHM):
            f0, f1 = directory / f"{cluster.tag}-h0", directory / f"{cluster.tag}-h1"
            _write_on(cluster, h0, f0, "a")
            _write_on(cluster, h1, f1, "b")
            assert _file_on(cluster, h0, f0) == "a\n"
            assert _file_on(cluster, h1, f1) == "b\n"
            assert _file_on(cluster, h1, f0) is None
            assert _file_on(cluster, h0, f1) is None
            assert not f0.exists() and not f1.exists()  # not in the test's namespace either
            # the same name on both hosts: two files
            _write_on(cluster, h1, f0, "c")
            assert (_file_on(cluster, h0, f0), _file_on(cluster, h1, f0)) == ("a\n", "c\n")
        for host in (h0, h1):
            assert _file_on(cluster, host, own) is None
            df = cluster.run(host, f"df -k --output=size {shlex.quote(str(store))} /dev/shm")
            assert df.stdout.split()[1:] == [str(64 * 1024)] * 2, df.stdout  # private_size
        assert own.read_text() == "launcher\n"
        assert _own_mounts_under(store, SHM) == mounts_before
        assert _private_mount_points(Path("/proc/self/mountinfo").read_text(), cluster) == set()
        assert _private_mounts_anywhere(cluster) == {str(store.resolve()), str(SHM.resolve())}  # in the hosts'
    finally:
        cluster.close()
        own.unlink(missing_ok=True)
    assert _own_mounts_under(store, SHM) == mounts_before
    assert _private_mounts_anywhere(cluster) == set()  # gone with the hosts' mount namespaces
    assert list(store.iterdir()) == []


@pytest.mark.timeout(120)
def test_a_rebooted_host_has_empty_private_disks_again(tmp_path) -> None:
    store = tmp_path / "store"
    cluster = start_cluster(2, tmp_path / "hosts", private=(store, "/dev/shm"))
    try:
        h0, h1 = cluster.hosts
        files = [directory / f"{cluster.tag}-f" for directory in (store, SHM)]
        for host in (h0, h1):
            for f in files:
                _write_on(cluster, host, f, host.name)
        cluster.crash(h0)
        cluster.boot(h0)
        for f in files:
            assert _file_on(cluster, h0, f) is None
            assert _file_on(cluster, h1, f) == "h1\n"  # the other machine kept its own
        assert cluster.run(h0, f"ls -A {shlex.quote(str(store))}").stdout == ""
        seen = _private_mount_points(cluster.run(h0, "cat /proc/self/mountinfo").stdout, cluster)
        assert seen == {str(store.resolve()), str(SHM.resolve())}
        _write_on(cluster, h0, files[0], "again")  # a disk, not merely an empty directory
        assert _file_on(cluster, h0, files[0]) == "again\n"
        assert not files[0].exists()  # still the host's own, not the test's directory
        assert _file_on(cluster, h1, files[0]) == "h1\n"
    finally:
        cluster.close()
    assert _private_mounts_anywhere(cluster) == set()


def test_private_disks_without_namespaces_are_refused(tmp_path, monkeypatch) -> None:
    """Where no network namespace can be made, the hosts would share the test's mounts: say so, start nothing."""
    ip = testhosts._ip

    def no_namespaces(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        if args[:2] == ("netns", "add"):
            return subprocess.CompletedProcess(["ip", *args], 1, "", "mount --make-shared /run/netns failed: "
                                                                     "Operation not permitted")
        return ip(*args, check=check)

    monkeypatch.setattr(testhosts, "_ip", no_namespaces)
    with pytest.raises(RuntimeError, match=r"private disks need a mount namespace per host.*Operation not permitted"):
        start_cluster(2, tmp_path / "hosts", private=(tmp_path / "store",))


@pytest.mark.parametrize("private, size, message", [
    (("relative/store",), "4g", "absolute"),
    (("/",), "4g", "must not hide"),
    (("{tmp}",), "4g", "must not hide"),  # above the workdir: sshd's own files
    (("{tmp}/file",), "4g", "must be a directory"),
    (("/dev/shm",), "4g,nr_inodes=1", "private_size"),
])
def test_bad_private_disks_are_refused_before_anything_starts(tmp_path, private, size, message) -> None:
    (tmp_path / "file").write_text("")
    paths = [p.format(tmp=tmp_path) for p in private]
    with pytest.raises(ValueError, match=message):
        start_cluster(2, tmp_path / "hosts", private=paths, private_size=size)
    assert not (tmp_path / "hosts").exists()
