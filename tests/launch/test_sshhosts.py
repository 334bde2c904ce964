"""Smoke test of the SSH test hosts: logins, the venv on every host, host-to-host and host-to-manager TCP, and a
teardown that leaves no namespace, interface or sshd behind."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys

import pytest

from devtools.testhosts import start_cluster


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
