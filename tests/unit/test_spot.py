"""Spot notices (varuna_core.launch.spot): each cloud's documented answers served by a local HTTP server on
127.0.0.1, and hostile ones (huge, nested, trickled, redirected, wrong types) that must be no notice, quickly."""

from __future__ import annotations

import email.utils
import json
import time

import pytest

from devtools.metadata import MetadataServer
from varuna_core.launch.spot import MAX_BODY, SpotWatcher, check

NOW = 1_800_000_000.0


@pytest.fixture()
def server():
    with MetadataServer() as srv:
        yield srv


AZURE = ("GET", "/metadata/scheduledevents?api-version=2020-07-01")
AWS_TOKEN = ("PUT", "/latest/api/token")
AWS_ACTION = ("GET", "/latest/meta-data/spot/instance-action")
GCP = ("GET", "/computeMetadata/v1/instance/preempted")


def _azure(server, events) -> None:
    server.required[AZURE] = {"Metadata": "true"}
    server.routes[AZURE] = (200, json.dumps({"DocumentIncarnation": 2, "Events": events}).encode())


def _event(kind="Preempt", seconds=45.0, resources=("vm-1",), event_id="E1") -> dict:
    not_before = email.utils.formatdate(NOW + seconds, usegmt=True) if seconds is not None else ""
    return {"EventId": event_id, "EventType": kind, "ResourceType": "VirtualMachine", "Resources": list(resources),
            "EventStatus": "Scheduled", "NotBefore": not_before, "Description": "", "EventSource": "Platform"}


def test_azure_scheduled_events(server) -> None:
    _azure(server, [_event("Reboot", 5), _event("Preempt", 45)])
    notice = check("azure", server.base, now=NOW)
    assert notice.source == "azure" and notice.event == "E1" and notice.seconds == pytest.approx(45, abs=1)
    _azure(server, [_event("Terminate", None, event_id="E2")])  # started: NotBefore is empty
    assert check("azure", server.base, now=NOW).seconds == 0
    _azure(server, [_event("Preempt", 30, resources=("vm-2",))])
    assert check("azure", server.base, now=NOW, vm_name="vm-1") is None  # another VM's eviction
    assert check("azure", server.base, now=NOW, vm_name="vm-2").seconds == pytest.approx(30, abs=1)
    _azure(server, [_event("Freeze", 10), _event("Redeploy", 10)])
    assert check("azure", server.base, now=NOW) is None
    server.required[AZURE] = {"Metadata": "true"}
    assert server.asked[-1][2].get("Metadata") == "true"


def test_aws_instance_action_through_imdsv2(server) -> None:
    server.required[AWS_ACTION] = {"X-aws-ec2-metadata-token": "tok-123"}
    server.required[AWS_TOKEN] = {"X-aws-ec2-metadata-token-ttl-seconds": "300"}
    server.routes[AWS_TOKEN] = (200, b"tok-123")
    assert check("aws", server.base, now=NOW) is None  # 404: nothing scheduled
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW + 120))
    server.routes[AWS_ACTION] = (200, json.dumps({"action": "terminate", "time": when}).encode())
    notice = check("aws", server.base, now=NOW)
    assert notice.seconds == pytest.approx(120, abs=1) and "terminate" in notice.detail
    server.routes[AWS_TOKEN] = (200, b"wrong")  # the action document refuses the token: no notice
    assert check("aws", server.base, now=NOW) is None


def test_gcp_preempted_key(server) -> None:
    server.required[GCP] = {"Metadata-Flavor": "Google"}
    server.routes[GCP] = (200, b"FALSE")
    assert check("gcp", server.base) is None
    server.routes[GCP] = (200, b"TRUE")
    assert check("gcp", server.base).seconds == 0


def _trickle(handler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", "1000")
    handler.end_headers()
    for _ in range(1000):
        handler.wfile.write(b"[")
        handler.wfile.flush()
        time.sleep(0.05)


def _redirect(handler) -> None:
    handler.send_response(302)
    handler.send_header("Location", "http://127.0.0.1:1/elsewhere")
    handler.send_header("Content-Length", "0")
    handler.end_headers()


@pytest.mark.parametrize("body", [
    b"x" * (MAX_BODY + 10),  # huge
    b"[" * 100_000,  # nested past the parser's recursion
    b"\xff\xfe not utf-8",
    b"null", b"[]", b'{"Events": {"a": 1}}', b'{"Events": [1, "x", null, {"EventType": ["Preempt"]}]}',
    json.dumps({"Events": [{"EventId": "E", "EventType": "Preempt", "Resources": [],
                            "NotBefore": "not a date"}]}).encode(),
    json.dumps({"Events": [{"EventId": 7, "EventType": "Preempt", "NotBefore": ""}]}).encode(),
    _trickle, _redirect,
], ids=["huge", "nested", "binary", "null", "list", "events-dict", "bad-entries", "bad-date", "bad-id", "trickle",
        "redirect"])
def test_hostile_answers_are_no_notice_and_quick(server, body) -> None:
    server.routes[AZURE] = (200, body)
    started = time.monotonic()
    assert check("azure", server.base, now=NOW, timeout=0.5) is None
    # the trickle takes 50 s to send its body: a reader that honours its deadline is done long before half of it
    assert time.monotonic() - started < 25


@pytest.mark.parametrize("doc", [{"action": "reboot", "time": "2030-01-01T00:00:00Z"}, {"action": "stop"},
                                 {"action": ["stop"], "time": "2030-01-01T00:00:00Z"},
                                 {"action": "stop", "time": "9999999-01-01T00:00:00Z"},
                                 {"action": "stop", "time": "yesterday"}, {"action": "stop", "time": 5}, [1]])
def test_aws_documents_not_as_documented_are_no_notice(server, doc) -> None:
    server.routes[AWS_TOKEN] = (200, b"t")
    server.routes[AWS_ACTION] = (200, json.dumps(doc).encode())
    assert check("aws", server.base, now=NOW) is None


def test_nothing_listening_and_bad_addresses() -> None:
    assert check("gcp", "http://127.0.0.1:1", timeout=0.5) is None
    for bad in ("https://x", "ftp://x", "http://", "http://h/path", "http://h?q=1"):
        with pytest.raises(ValueError):
            check("aws", bad)
    with pytest.raises(ValueError, match="unknown preemption source"):
        check("oracle")


def test_watcher_calls_back_once_per_event(server) -> None:
    _azure(server, [_event("Preempt", 60)])
    got: list = []
    watcher = SpotWatcher("azure", got.append, base=server.base, interval=0.05).start()
    try:
        deadline = time.monotonic() + 30  # a positive wait: it ends when the condition holds
        while len(server.asked) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        _azure(server, [_event("Preempt", 60), _event("Terminate", None, event_id="E9")])
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watcher.stop(timeout=5)
    assert [n.event for n in got] == ["E1", "E9"]
    with pytest.raises(ValueError):
        SpotWatcher("azure", got.append, base="https://x")


AZURE_NAME = ("GET", "/metadata/instance/compute/name?api-version=2021-02-01&format=text")


@pytest.mark.parametrize(("name", "expected"), [
    (b"vm-2", ["E2"]),  # the VM's own events only: a scale set's events name every VM they affect
    # not a name: every eviction counts (the soonest is the notice)
    (b"-rf /", ["E1"]), (b"x" * 200, ["E1"]), (b"", ["E1"]), (b"\xff", ["E1"]),
])
def test_an_azure_watcher_keeps_to_its_own_vm(server, name, expected) -> None:
    server.required[AZURE_NAME] = {"Metadata": "true"}
    server.routes[AZURE_NAME] = (200, name)
    _azure(server, [_event("Preempt", 60, resources=("vm-1",)), _event("Preempt", 60, ("vm-2", "vm-3"), "E2")])
    got = []
    watcher = SpotWatcher("azure", got.append, base=server.base, interval=0.05).start()
    try:
        deadline = time.monotonic() + 30  # a positive wait: it ends when the condition holds
        while len(server.asked) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watcher.stop(timeout=5)
    assert sorted(n.event for n in got) == expected


# --- endpoints checked up front ---------------------------------------------------------------------------

SECRET = "s3cr3t-pw"
BAD_ENDPOINTS = [
    ("http://127.0.0.1:0", "port 0 is not in 1..65535"),
    ("http://127.0.0.1:65536", "the port is not a number in 1..65535"),
    ("http://127.0.0.1:99999999", "the port is not a number in 1..65535"),
    ("http://127.0.0.1:-1", "the port is not a number in 1..65535"),
    (f"http://admin:{SECRET}@169.254.169.254", "holds credentials"),
    (f"http://{SECRET}@169.254.169.254:80", "holds credentials"),
    (f"http://admin:{SECRET}/x@169.254.169.254", "holds credentials"),  # a '/' in the password
    ("http://" + "a" * 1100, "more than the 1,024 the node agents take"),
    ("ftp://169.254.169.254", "the scheme is 'ftp'"),
    ("169.254.169.254", "no scheme"),
    ("http://", "names no host"),
    ("http://:8080", "names no host"),
    ("http://meta\ndata", "whitespace or control characters"),  # urllib would drop the newline silently
    ("http://a b", "whitespace or control characters"),
    ("http://h#frag", "path, query or fragment"),
    ("http://h/latest", "path, query or fragment"),
    ("http://[::1", "http://host[:port]"),
]


@pytest.mark.parametrize(("endpoint", "needle"), BAD_ENDPOINTS, ids=[e[1] for e in BAD_ENDPOINTS])
def test_bad_endpoints_are_refused_without_showing_credentials(endpoint, needle) -> None:
    from varuna_core.errors import ConfigError
    from varuna_core.launch.options import LaunchOptions, SpotConfig
    from varuna_core.launch.spot import check_endpoint

    with pytest.raises(ValueError) as info:
        check_endpoint(endpoint)
    assert needle in str(info.value) and SECRET not in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError) as info:  # a program that fills LaunchOptions gets the same check
        LaunchOptions(script=["train.py"], run_dir=".", ckpt_dir=".", spot=SpotConfig("aws", endpoint))
    assert needle in info.value.message and SECRET not in str(info.value)


def test_the_endpoint_limit_is_the_agent_protocols() -> None:
    from varuna_core.launch.protocol import MAX_ENDPOINT, SpotWatch
    from varuna_core.launch.spot import check_endpoint

    longest = "http://" + "a" * (MAX_ENDPOINT - len("http://"))
    SpotWatch(source="aws", endpoint=longest)  # the agent takes it (as a string; no host name is that long)
    with pytest.raises(ValueError) as info:
        check_endpoint(longest)
    assert "is not a host name" in str(info.value) and "more than" not in str(info.value)
    with pytest.raises(ValueError, match=f"more than the {MAX_ENDPOINT:,} the node agents take"):
        check_endpoint(longest + "a")


@pytest.mark.parametrize("endpoint", ["http://169.254.169.254", "http://metadata.google.internal/",
                                      "http://127.0.0.1:8080", "http://[::1]:80", "http://Node_1.local:1"])
def test_good_endpoints(endpoint) -> None:
    from varuna_core.launch.options import SpotConfig

    assert SpotConfig("gcp", endpoint).endpoint == endpoint


def test_an_unknown_source_is_refused_when_the_config_is_made() -> None:
    from varuna_core.errors import ConfigError
    from varuna_core.launch.options import SpotConfig

    with pytest.raises(ConfigError, match="source 'oracle' is not one of azure, aws, gcp"):
        SpotConfig("oracle")
