"""`kvpilot-runtime serve` flags -> ServeConfig, and --model URIs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.contract.serve_config import (
    ServeConfig,
    build_parser,
    parse_args,
    parse_lora_module,
    to_args,
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "my-model"
    path.mkdir()
    return path


def test_defaults_follow_design(model_dir: Path) -> None:
    config = parse_args(["--model", str(model_dir)])
    assert config.model == str(model_dir)
    assert config.served_name == "my-model"
    assert (config.port, config.quantization, config.max_num_seqs) == (8000, "none", 64)
    assert config.enable_prefix_caching and config.api_key is None
    assert config.kv_cache_memory is None and config.gpu_memory_utilization == 0.9
    assert not config.enforce_eager  # CUDA graphs where they can run, as vLLM


def test_every_flag_reaches_the_config(model_dir: Path) -> None:
    config = parse_args([
        "--model", f"file://{model_dir}", "--served-name", "m", "--quantization", "int4",
        "--max-model-len", "128", "--max-num-seqs", "3", "--kv-cache-memory", "1048576",
        "--port", "9000", "--host", "127.0.0.1", "--max-num-batched-tokens", "64",
        "--max-waiting", "5", "--api-key", "k", "--shutdown-timeout", "7", "--dtype", "bfloat16",
        "--device", "cpu", "--no-prefix-caching", "--max-request-body-bytes", "4096",
        "--max-seqs-per-request", "6", "--request-body-timeout", "2.5",
        "--scheduling-policy", "priority", "--enforce-eager",
    ])  # fmt: skip
    assert config == ServeConfig(
        model=str(model_dir), served_name="m", host="127.0.0.1", port=9000,
        quantization="int4", dtype="bfloat16", device="cpu", max_model_len=128, max_num_seqs=3,
        max_num_batched_tokens=64, kv_cache_memory=1048576, enable_prefix_caching=False,
        max_waiting=5, api_key="k", shutdown_timeout=7.0, max_request_body_bytes=4096,
        max_seqs_per_request=6, request_body_timeout=2.5, scheduling_policy="priority",
        enforce_eager=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("pvc://claim/models/llama", "operator mounts pvc:// models"),
        ("gs://bucket/model", "unknown scheme gs://"),
        ("hf://just-a-name", "expected hf://ORG/NAME"),
        ("s3://bucket", "name the folder"),
        ("/does/not/exist", "not a directory"),
        ("file:///does/not/exist", "not a directory"),
    ],
)
def test_model_uris_the_runtime_cannot_load_are_clear_errors(uri: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_args(["--model", uri])


@pytest.mark.parametrize(
    ("uri", "served_name"),
    [
        ("hf://kvpilot/tiny-llama", "tiny-llama"),
        ("hf://kvpilot/tiny-llama@v1", "tiny-llama"),
        ("s3://models/team/tiny-llama/", "tiny-llama"),
    ],
)
def test_fetched_models_stay_uris_until_load(uri: str, served_name: str) -> None:
    config = parse_args(["--model", uri])
    assert (config.model, config.served_name) == (uri, served_name)


def test_file_uri_with_escapes(tmp_path: Path) -> None:
    path = tmp_path / "with space"
    path.mkdir()
    config = parse_args(["--model", f"file://{str(path).replace(' ', '%20')}"])
    assert config.model == str(path)


def test_every_field_is_a_flag_and_to_args_round_trips(model_dir: Path) -> None:
    """The operator's writer and the runtime's parser agree on every field."""
    values = {
        "model": str(model_dir), "served_name": "m", "quantization": "int8", "dtype": "float16",
        "int8_kernel": "w8a16", "attention_backend": "sdpa", "expect_checkpoint": "awq-int4",
        "device": "cpu", "max_model_len": 99, "max_num_seqs": 5, "max_num_batched_tokens": 77,
        "kv_cache_memory": 4096, "enable_prefix_caching": False, "seed": 3,
        "tensor_parallel_size": 2, "kv_cache_dtype": "fp8", "host": "127.0.0.2", "port": 9001,
        "max_waiting": 7, "api_key": "k", "shutdown_timeout": 2.5, "log_level": "debug",
        "tool_call_parser": "hermes",
        "max_request_body_bytes": 2048, "threads": 1, "max_seqs_per_request": 9,
        "request_body_timeout": 4.5, "scheduling_policy": "priority",
        "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
        "enable_lora": True, "max_loras": 3, "max_lora_rank": 32, "max_cpu_loras": 5,
        "enforce_eager": True,
        "lora_modules": ("a=/adapters/a", '{"name": "b", "path": "/adapters/b"}'),
        "lora_cache_dir": "/mnt/models/.adapters",
        "lora_claims": ("loras=/mnt/lora-claims/loras", "more=/mnt/lora-claims/more"),
        # KV tiers need prefix caching and one rank: round-tripped in the test below
        "kv_offloading_size": None, "kv_offloading_backend": "native",
        "kv_offloading_disk_path": None, "kv_offloading_disk_size": None,
    }  # fmt: skip
    fields_of_config = {
        f for f in ServeConfig.__dataclass_fields__ if f != "gpu_memory_utilization"
    }
    assert set(values) == fields_of_config  # a new field must be added here, with a flag
    assert parse_args(to_args(values)) == ServeConfig(**values)  # type: ignore[arg-type]


def test_kv_offloading_flags_round_trip(model_dir: Path) -> None:
    values = {
        "model": str(model_dir), "served_name": "m", "kv_offloading_size": 1.5,
        "kv_offloading_backend": "native",
        "kv_offloading_disk_path": "/var/cache/kv", "kv_offloading_disk_size": 20.0,
    }  # fmt: skip
    assert parse_args(to_args(values)) == ServeConfig(**values)  # type: ignore[arg-type]
    assert "--kv-offloading-size=1.5" in to_args(values)


def test_to_args_refuses_a_name_the_runtime_does_not_parse() -> None:
    with pytest.raises(KeyError, match="kv_dtype"):
        to_args({"kv_dtype": "fp8"})


def test_every_flag_has_help() -> None:
    for action in build_parser()._actions:
        assert action.help, action.dest


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("port", 0, "port"),
        ("quantization", "fp4", "quantization"),
        ("int8_kernel", "w4a8", "int8_kernel"),
        ("attention_backend", "flash", "attention_backend"),
        ("max_num_seqs", 0, "max_num_seqs"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
        ("kv_cache_memory", 0, "kv_cache_memory"),
        ("max_waiting", -1, "max_waiting"),
        ("shutdown_timeout", -1.0, "shutdown_timeout"),
        ("api_key", "", "api_key"),
        ("max_model_len", 0, "max_model_len"),
        ("max_request_body_bytes", 100, "max_request_body_bytes"),
        ("max_seqs_per_request", 0, "max_seqs_per_request"),
        ("request_body_timeout", 0.0, "request_body_timeout"),
    ],
)
def test_bad_values_raise_value_error(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServeConfig(model="m", served_name="m", **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("max_seqs_per_request", "max_num_seqs", "max_waiting", "limit"),
    [
        (256, 64, 256, 256),  # the defaults: the flag
        (256, 1, 1, 2),  # a small server: what it can hold at once
        (256, 8, 0, 8),  # no queue: the batch
        (4, 8, 100, 4),
    ],
)
def test_one_request_holds_at_most_the_flag_and_what_the_server_holds(
    max_seqs_per_request: int, max_num_seqs: int, max_waiting: int, limit: int
) -> None:
    config = ServeConfig(model="m", served_name="m", max_seqs_per_request=max_seqs_per_request,
                         max_num_seqs=max_num_seqs, max_waiting=max_waiting)  # fmt: skip
    assert config.request_seq_limit == limit


def test_memory_flags_are_exclusive(model_dir: Path) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model", str(model_dir), "--gpu-memory-utilization", "0.5",
                    "--kv-cache-memory", "100"])  # fmt: skip


def test_serve_main_reports_a_bad_model_uri(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpilot.runtime.server.app import main

    assert main(["--model", "pvc://claim/path"]) == 2
    assert "operator mounts pvc:// models into the pod at a path" in capsys.readouterr().err


def test_serve_main_refuses_more_threads_than_cores(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpilot.runtime.engine import machine, machine_files
    from kvpilot.runtime.server.app import main

    cores = machine.available_cores(machine_files.cpu_quota(), machine_files.affinity_cores())
    assert main(["--model", str(model_dir), "--threads", str(cores + 1)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvpilot-runtime serve: --threads {cores + 1}: this process may use")
    assert err.endswith(f"pass 1..{cores}\n") and err.count("\n") == 1


def test_threads_flag_is_parsed(model_dir: Path) -> None:
    assert parse_args(["--model", str(model_dir), "--threads", "1"]).threads == 1
    assert parse_args(["--model", str(model_dir)]).threads is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sql=/adapters/sql", ("sql", "/adapters/sql")),
        ("a=b=c", ("a", "b=c")),  # the first '=' splits
        ('{"name": "sql", "path": "/adapters/sql"}', ("sql", "/adapters/sql")),
        ('{"name": "sql", "path": "/a", "base_model_name": "m"}', ("sql", "/a")),
    ],
)
def test_lora_modules_take_vllms_two_forms(text: str, expected: tuple[str, str]) -> None:
    assert parse_lora_module(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("sql", "expected NAME=PATH"),
        ("=/a", "expected NAME=PATH"),
        ('{"name": "sql"}', "expected NAME=PATH"),
        ('{"name": "sql", "path": "/a", "rank": 8}', r"unknown keys \['rank'\]"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_lora_modules_are_clear_errors(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_lora_module(text)


def test_lora_modules_need_enable_lora_and_unique_names(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs --enable-lora"):
        parse_args(["--model", str(model_dir), "--lora-modules", "a=/x"])
    with pytest.raises(ValueError, match="must be unique"):
        parse_args(["--model", str(model_dir), "--enable-lora", "--lora-modules", "a=/x", "a=/y"])
    config = parse_args(
        [
            "--model",
            str(model_dir),
            "--enable-lora",
            "--lora-modules",
            "a=/x",
            "--lora-modules=b=/y",
        ]
    )
    assert config.lora_adapters == [("a", "/x"), ("b", "/y")]
