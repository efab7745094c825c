"""The model servers' pure pieces: configs, argv, the git mirror and the `env` exports."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from hack.devcluster import __main__ as cli
from hack.devcluster import modelsources
from hack.devcluster.errors import DevClusterError
from hack.devcluster.modelsources import (
    HF_REPO_ID,
    MODEL_DIR,
    build_olah_config,
    build_s3_identities,
    client_env,
    make_hf_mirror,
    olah_argv,
    weed_argv,
)


def test_olah_is_offline_on_loopback_and_serves_the_mirrors(tmp_path: Path) -> None:
    config = build_olah_config(4321, tmp_path / "cache", tmp_path / "mirrors")
    assert config["accessibility"]["offline"] is True
    assert config["basic"]["host"] == "127.0.0.1"
    assert config["basic"]["port"] == 4321
    assert config["basic"]["mirrors-path"] == [str(tmp_path / "mirrors")]
    argv = olah_argv(tmp_path / "olah.toml", tmp_path / "logs")
    # Without --log-path olah writes ./logs into the repo root.
    assert argv[argv.index("--log-path") + 1] == str(tmp_path / "logs")


def test_the_mirror_is_a_git_repo_of_the_model_with_a_reproducible_sha(tmp_path: Path) -> None:
    first = make_hf_mirror(MODEL_DIR, tmp_path / "a", HF_REPO_ID)
    second = make_hf_mirror(MODEL_DIR, tmp_path / "b", HF_REPO_ID)
    assert re.fullmatch(r"[0-9a-f]{40}", first)
    assert first == second  # fixed author, committer and dates
    repo = tmp_path / "a" / "models" / HF_REPO_ID
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", "main"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert sorted(listed) == sorted(p.name for p in MODEL_DIR.iterdir() if p.is_file())


def test_s3_config_has_one_identity_with_the_given_keys() -> None:
    config = build_s3_identities("AK", "SK")
    (identity,) = config["identities"]
    assert identity["credentials"] == [{"accessKey": "AK", "secretKey": "SK"}]
    assert {"Read", "List", "Write"} <= set(identity["actions"])


def test_weed_sets_every_port_binds_loopback_and_sends_no_telemetry(tmp_path: Path) -> None:
    internal = [20001, 20002, 20003, 20004, 20005, 20006, 20007]
    argv = weed_argv(tmp_path / "data", tmp_path / "s3.json", 20000, internal)
    flags = dict(arg.lstrip("-").split("=", 1) for arg in argv[2:] if "=" in arg)
    ports = {k: int(v) for k, v in flags.items() if re.search(r"port(\.grpc)?$", k)}
    # A port left at 0 would default to HTTP port + 10000, which may be taken.
    assert sorted(ports.values()) == [20000, *internal]
    assert flags["ip.bind"] == "127.0.0.1"
    assert flags["master.telemetry"] == "false"
    assert flags["s3.port.iceberg"] == flags["s3.port.lance"] == "0"
    assert flags["s3.config"] == str(tmp_path / "s3.json")
    assert argv[1] == "server" and "-s3" in argv and "-filer" in argv


def test_client_env_names_both_endpoints_and_the_credentials() -> None:
    env = client_env(7001, 7002)
    assert env["HF_ENDPOINT"] == "http://127.0.0.1:7001"
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:7002"
    assert env["AWS_ACCESS_KEY_ID"] == modelsources.S3_ACCESS_KEY
    assert env["AWS_SECRET_ACCESS_KEY"] == modelsources.S3_SECRET_KEY
    assert env["AWS_REGION"] == modelsources.S3_REGION


def exports(output: str) -> dict[str, str]:
    found = {}
    for line in output.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        found[key] = value
    return found


def test_env_prints_the_model_server_exports_of_a_cluster_that_is_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ports = {"etcd_client": 1, "etcd_peer": 2, "apiserver": 3, "controller_manager": 4}
    ports |= {"scheduler": 5, "prometheus": 6, "s3": 7002, "hf_hub": 7001}
    (tmp_path / "ports.json").write_text(json.dumps(ports))
    assert cli.main(["env", "--state-dir", str(tmp_path)]) == 0
    found = exports(capsys.readouterr().out)
    assert {k: shlex.split(v)[0] for k, v in found.items() if k != "PATH"} == {
        "KUBECONFIG": str(tmp_path / "kubeconfig"),
        **client_env(7001, 7002),
    }


def test_env_of_a_cluster_never_started_has_no_model_servers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["env", "--state-dir", str(tmp_path)]) == 0
    assert set(exports(capsys.readouterr().out)) == {"KUBECONFIG", "PATH"}


def test_a_missing_package_is_one_line_naming_it() -> None:
    with pytest.raises(DevClusterError, match=r"^the Hugging Face hub needs .* no_such_pkg,"):
        modelsources.require_module("no_such_pkg", "the Hugging Face hub")
    modelsources.require_module("json", "anything")  # present: no error
