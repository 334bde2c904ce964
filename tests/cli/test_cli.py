"""The `varuna` root command: version, help, `env`, usage errors, and the error/exit-code mapping of main()."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

import varuna_cli.app as cli
from varuna_core.errors import ConfigError, TopologyError, VarunaError

VARUNA = Path(sys.executable).parent / "varuna"  # the installed console script, next to the interpreter
VERSION = metadata.version("varuna")
ENV_KEYS = {
    "varuna", "python", "platform", "os", "cpus", "torch", "torch_build", "cuda_available", "cuda_devices",
    "distributed_backends", "torch_threads", "torch_interop_threads", "OMP_NUM_THREADS",
    "numpy", "typer", "rich", "pydantic",
}

runner = CliRunner()


def run_script(*args: str) -> subprocess.CompletedProcess:
    assert VARUNA.exists(), f"console script not installed at {VARUNA}; run `make setup`"
    env = {k: v for k, v in os.environ.items() if k != "VARUNA_DEBUG"}
    return subprocess.run([str(VARUNA), *args], capture_output=True, text=True, env=env, timeout=120)


# --- CliRunner ------------------------------------------------------------------------------------------

def test_version():
    result = runner.invoke(cli.app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"varuna {VERSION}"


def test_help_lists_env():
    result = runner.invoke(cli.app, ["--help"])
    assert result.exit_code == 0
    assert "env" in result.stdout and "--version" in result.stdout


def test_env_human():
    import torch

    result = runner.invoke(cli.app, ["env"])
    assert result.exit_code == 0, result.output
    assert torch.__version__ in result.stdout
    assert "distributed_backends" in result.stdout


def test_env_json(monkeypatch):
    import torch

    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.setenv("VARUNA_SOMETHING", "x")
    result = runner.invoke(cli.app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert ENV_KEYS <= set(info)
    assert info["torch"] == torch.__version__
    assert info["varuna"] == VERSION
    assert "gloo" in info["distributed_backends"]
    assert info["env.MASTER_PORT"] == "29511" and info["env.VARUNA_SOMETHING"] == "x"
    assert all(isinstance(v, str) for v in info.values())


def test_unknown_command_is_usage_error():
    result = runner.invoke(cli.app, ["no-such-command"])
    assert result.exit_code == 2


# --- the installed console script -----------------------------------------------------------------------

def test_script_version_and_help():
    result = run_script("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"varuna {VERSION}"
    result = run_script("--help")
    assert result.returncode == 0 and "env" in result.stdout


def test_script_env_json():
    import torch

    result = run_script("env", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)  # stdout is exactly one JSON document
    assert ENV_KEYS <= set(info) and info["torch"] == torch.__version__


def test_script_env_human_block_on_stdout():
    result = run_script("env")
    assert result.returncode == 0, result.stderr
    assert all(line.startswith("- ") for line in result.stdout.splitlines())
    assert "bug report" in result.stderr


def test_script_unknown_command_exits_2():
    result = run_script("no-such-command")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_cli_import_does_not_import_torch():
    code = "import sys, varuna_cli.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# --- main(): errors -> one line + exit code ------------------------------------------------------------

def _raising(exc: BaseException):
    def fake_app(*args, **kwargs):
        raise exc

    return fake_app


@pytest.fixture
def no_debug(monkeypatch):
    monkeypatch.delenv("VARUNA_DEBUG", raising=False)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ConfigError("batch size 7 is not divisible by 2 replicas"), 2),
        (TopologyError("stage 1 of map '0;' is empty"), 2),
        (VarunaError("p2p wait timed out"), 1),
    ],
)
def test_main_maps_varuna_errors(monkeypatch, capsys, no_debug, exc, code):
    monkeypatch.setattr(cli, "app", _raising(exc))
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == code
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"error: {exc.message}"]


def test_main_prints_hint_line(monkeypatch, capsys, no_debug):
    monkeypatch.setattr(cli, "app", _raising(ConfigError("bad map '0;;1'", hint="use '0;1'")))
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == ["error: bad map '0;;1'", "hint: use '0;1'"]


def test_main_unexpected_exception(monkeypatch, capsys, no_debug):
    monkeypatch.setattr(cli, "app", _raising(RuntimeError("boom")))
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "error: RuntimeError: boom"
    assert "VARUNA_DEBUG=1" in lines[1] and len(lines) == 2


def test_main_keyboard_interrupt(monkeypatch, capsys, no_debug):
    monkeypatch.setattr(cli, "app", _raising(KeyboardInterrupt()))
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 130


def test_main_debug_reraises(monkeypatch):
    monkeypatch.setenv("VARUNA_DEBUG", "1")
    monkeypatch.setattr(cli, "app", _raising(ConfigError("bad")))
    with pytest.raises(ConfigError):
        cli.main([])


def test_main_in_a_process_no_traceback_unless_debug():
    code = (
        "import varuna_cli.app as a\n"
        "from varuna_core.errors import ConfigError\n"
        "def fake(*args, **kwargs):\n"
        "    raise ConfigError('bad input', hint='fix it')\n"
        "a.app = fake\n"
        "a.main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VARUNA_DEBUG"}
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert quiet.returncode == 2
    assert quiet.stderr.splitlines() == ["error: bad input", "hint: fix it"]
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "VARUNA_DEBUG": "1"}, timeout=120)
    assert loud.returncode == 1
    assert "Traceback (most recent call last)" in loud.stderr and "ConfigError: bad input" in loud.stderr
