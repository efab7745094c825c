"""Pure parts of the local pod runner: pod IPs, argv/env of a container, probes, restarts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from hack.podrunner import images, pods

POD: dict[str, Any] = {
    "metadata": {"name": "rt-0", "namespace": "ml", "uid": "u1"},
    "spec": {"nodeName": "local-0", "containers": [{"name": "runtime", "image": "img"}]},
    "status": {},
}


@pytest.mark.parametrize(
    ("cidr", "taken", "expected"),
    [
        ("127.70.0.0/24", set(), "127.70.0.2"),
        ("127.70.0.0/24", {"127.70.0.2", "127.70.0.3"}, "127.70.0.4"),
        ("127.70.1.0/30", set(), "127.70.1.2"),
    ],
)
def test_next_pod_ip_skips_the_node_address_and_taken_ones(
    cidr: str, taken: set[str], expected: str
) -> None:
    assert pods.next_pod_ip(cidr, taken) == expected


def test_next_pod_ip_reports_exhaustion() -> None:
    with pytest.raises(ValueError, match="no free address"):
        pods.next_pod_ip("127.70.1.0/30", {"127.70.1.2"})


@pytest.mark.parametrize(
    ("container", "expected_tail"),
    [
        (
            {"name": "c", "command": ["python3"], "args": ["--port", "8000"], "ports": [{}]},
            ["--port", "8000", "--host", "127.70.0.2"],
        ),
        (
            {"name": "c", "command": ["python3", "--host", "0.0.0.0"], "ports": [{}]},
            ["--host", "127.70.0.2"],
        ),
        ({"name": "init", "command": ["python3"], "args": ["fetch"]}, ["fetch"]),  # no ports
    ],
)
def test_argv_binds_the_pod_ip(container: dict[str, Any], expected_tail: list[str]) -> None:
    argv = pods.container_argv(container, "127.70.0.2", [Path(sys.executable).parent])
    assert Path(argv[0]).is_file()
    assert argv[-len(expected_tail) :] == expected_tail


def test_argv_of_a_container_without_command_is_its_images_entrypoint_without_init() -> None:
    """The operator writes args only, so the image's `tini --` stays PID 1 on a real cluster;
    on the host the runner starts and reaps the process itself, so the init is left out."""
    bin_dir = Path(sys.executable).parent
    image = "ghcr.io/kvpilot/runtime:1.2.3"
    container = {"name": "runtime", "image": image, "args": ["serve"]}
    assert images.host_entrypoint(image) == ["kvpilot-runtime"]
    argv = pods.container_argv(container, "127.70.0.2", [bin_dir], (), ["python3"])
    assert argv[1:] == ["serve"] and Path(argv[0]).name.startswith("python3")
    assert images.host_entrypoint("ghcr.io/kvpilot/operator:1.2.3") == ["kvpilot-operator"]
    assert images.host_entrypoint("docker.io/library/busybox:1") == []
    with pytest.raises(ValueError, match="not one kvpilot builds"):
        pods.container_argv({"name": "c", "image": "busybox", "args": ["x"]}, "127.0.0.2", [])


def test_argv_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="has no command"):
        pods.container_argv({"name": "c"}, "127.0.0.2", [])
    with pytest.raises(ValueError, match="'no-such-binary-xyz' not found"):
        pods.container_argv({"name": "c", "command": ["no-such-binary-xyz"]}, "127.0.0.2", [])


SECRETS = {("ml", "creds"): {"HF_TOKEN": "hf_x", "AWS_ACCESS_KEY_ID": "ak"}}


def read_secret(namespace: str, name: str) -> dict[str, str] | None:
    return SECRETS.get((namespace, name))


def test_env_resolves_values_secrets_and_downward_api_fields() -> None:
    container = {
        "name": "c",
        "envFrom": [{"secretRef": {"name": "creds"}}],
        "env": [
            {"name": "A", "value": "1"},
            {"name": "HF_HOME", "value": "/var/cache/kvpilot"},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "HF_TOKEN"}}},
        ],
    }
    mounts = [("/var/cache/kvpilot", "/state/pods/u1/volumes/cache")]
    assert pods.container_env(POD, container, "127.70.0.9", read_secret, mounts) == {
        "HF_TOKEN": "hf_x",
        "AWS_ACCESS_KEY_ID": "ak",
        "A": "1",
        "HF_HOME": "/state/pods/u1/volumes/cache",
        "POD": "rt-0",
        "IP": "127.70.0.9",
        "KEY": "hf_x",
    }


@pytest.mark.parametrize(
    ("env_source", "match"),
    [
        ({"envFrom": [{"secretRef": {"name": "missing"}}]}, 'secret "missing" not found'),
        (
            {"env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "x"}}}]},
            "couldn't find key x in Secret ml/creds",
        ),
    ],
)
def test_missing_secrets_are_config_errors(env_source: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pods.container_env(POD, {"name": "c", **env_source}, "127.70.0.9", read_secret)


def test_volumes_map_to_local_directories(tmp_path: Path) -> None:
    pod = {
        "metadata": {"namespace": "ml"},
        "spec": {
            "volumes": [
                {"name": "model", "emptyDir": {}},
                {"name": "weights", "persistentVolumeClaim": {"claimName": "w"}},
                {"name": "host", "hostPath": {"path": "/srv/m"}},
            ]
        },
    }
    dirs = pods.volume_dirs(pod, tmp_path / "pod", tmp_path / "claims")
    assert dirs == {
        "model": tmp_path / "pod" / "volumes" / "model",
        "weights": tmp_path / "claims" / "ml" / "w",  # shared by every pod of the claim
        "host": Path("/srv/m"),
    }


def test_config_map_volumes_project_keys_as_files() -> None:
    data, binary = {"eval.txt": "naïve text", "other": "x"}, {"bin": "AAE="}
    every = pods.config_map_files({"configMap": {"name": "c"}}, data, binary)
    assert every == {"eval.txt": "naïve text".encode(), "other": b"x", "bin": b"\x00\x01"}
    items = [{"key": "eval.txt", "path": "sets/eval.txt"}, {"key": "gone", "path": "g"}]
    listed = pods.config_map_files({"configMap": {"name": "c", "items": items}}, data, binary)
    assert listed == {"sets/eval.txt": "naïve text".encode()}


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("--model=file:///mnt/models", "--model=file:///local/model"),
        ("--model=file:///mnt/models/llama/8b", "--model=file:///local/weights/8b"),
        ("--to=/mnt/models", "--to=/local/model"),
        ("/mnt/modelsX", "/mnt/modelsX"),  # not a path boundary
        # a path as a JSON value (--speculative-config's draft model)
        ('{"model":"/mnt/models/llama"}', '{"model":"/local/weights"}'),
        ("--port=8000", "--port=8000"),
    ],
)
def test_mount_paths_in_args_become_local_directories(arg: str, expected: str) -> None:
    container = {
        "volumeMounts": [
            {"name": "model", "mountPath": "/mnt/models"},
            {"name": "weights", "mountPath": "/mnt/models/llama", "subPath": "x"},
        ]
    }
    dirs = {"model": Path("/local/model"), "weights": Path("/local/weights")}
    mounts = pods.container_mounts(container, dirs)
    assert mounts[0] == ("/mnt/models/llama", "/local/weights/x")  # the longest first
    mounts = [("/mnt/models/llama", "/local/weights"), ("/mnt/models", "/local/model")]
    assert pods.rewrite_paths(arg, mounts) == expected


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("--model=file:///mnt/models/x", "--model=file:///tmp/pod/model/x"),
        ("--scratch=/tmp/a /var/tmp/b", "--scratch=/tmp/pod/tmp/a /var/tmp/b"),
    ],
)
def test_a_path_is_rewritten_once_even_when_its_directory_starts_with_a_mount_path(
    arg: str, expected: str
) -> None:
    mounts = [("/mnt/models", "/tmp/pod/model"), ("/tmp", "/tmp/pod/tmp")]
    assert pods.rewrite_paths(arg, mounts) == expected


def test_initializing_status_is_pending_with_earlier_inits_completed() -> None:
    pod = {
        **POD,
        "spec": {
            **POD["spec"],
            "initContainers": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
        },
    }
    state = {"waiting": {"reason": "CrashLoopBackOff"}}
    status = pods.initializing_status(pod, "127.70.0.2", 1, state, restarts=3)
    assert status["phase"] == "Pending"
    reasons = [
        next(iter(s["state"].values())).get("reason") for s in status["initContainerStatuses"]
    ]
    assert reasons == ["Completed", "CrashLoopBackOff", "PodInitializing"]
    assert status["initContainerStatuses"][1]["restartCount"] == 3
    initialized = next(c for c in status["conditions"] if c["type"] == "Initialized")
    assert initialized["status"] == "False" and "[b]" in initialized["message"]


def test_termination_message_falls_back_to_the_log() -> None:
    log = "".join(f"line {i}\n" for i in range(6)) + "kvpilot-runtime fetch: hf://a/b: 404\n"
    fallback = {"terminationMessagePolicy": "FallbackToLogsOnError"}
    assert pods.termination_message(fallback, log).splitlines() == [
        "line 2", "line 3", "line 4", "line 5", "kvpilot-runtime fetch: hf://a/b: 404"
    ]  # fmt: skip
    assert pods.termination_message({"terminationMessagePolicy": "File"}, log) == ""
    assert pods.termination_message(fallback, log, exit_code=0) == ""  # only on error


@pytest.mark.parametrize("policy", ["File", "FallbackToLogsOnError"])
@pytest.mark.parametrize("exit_code", [0, 1])
def test_termination_message_written_by_the_container_wins(policy: str, exit_code: int) -> None:
    container = {"terminationMessagePolicy": policy}
    written = '{"files": 3, "bytes": 1024}'
    assert pods.termination_message(container, "log line\n", written, exit_code) == written
    assert pods.termination_message_path({}) == "/dev/termination-log"
    assert pods.termination_message_path({"terminationMessagePath": "/x"}) == "/x"


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        (None, None),
        ({"exec": {"command": ["true"]}}, None),
        ({"httpGet": {"path": "/ready", "port": 8000}}, "http://127.1.0.2:8000/ready"),
        ({"httpGet": {"path": "/health", "port": "http"}}, "http://127.1.0.2:8080/health"),
    ],
)
def test_probe_url(probe: dict[str, Any] | None, expected: str | None) -> None:
    container = {"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}
    assert pods.probe_url(probe, container, "127.1.0.2") == expected


@pytest.mark.parametrize(
    ("policy", "code", "restart"),
    [
        ("Always", 0, True),
        ("Always", 1, True),
        ("OnFailure", 0, False),
        ("OnFailure", 2, True),
        ("Never", 1, False),
    ],
)
def test_restart_policy(policy: str, code: int, restart: bool) -> None:
    assert pods.should_restart(policy, code) is restart


def test_status_documents() -> None:
    running = pods.running_status(POD, "127.70.0.2", True, 2, "2026-01-01T00:00:00Z")
    ready = {c["type"]: c["status"] for c in running["conditions"]}
    assert running["podIP"] == "127.70.0.2" and ready["Ready"] == "True"
    assert running["containerStatuses"][0]["restartCount"] == 2
    failed = pods.terminated_status(POD, 1, 0)
    assert failed["phase"] == "Failed"
    assert failed["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 1
    done = pods.terminated_status(POD, 0, 0, "fetched")
    assert done["phase"] == "Succeeded"
    assert done["containerStatuses"][0]["state"]["terminated"]["message"] == "fetched"
