"""The contract across the pod boundary, from both sides: every pod spec the operator can write
(each example in examples/, each plan shape) is parsed by the runtime's own parsers
(`kvpilot-runtime serve` and `fetch`), so a flag the runtime does not know fails here, not in a
crash-looping pod on a GPU node."""

from __future__ import annotations

import dataclasses
import itertools
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.images.spec import RUNTIME
from hack.podrunner import pods as podrunner_pods
from kvpilot.contract import adapter_cache, fetch, serve_config
from kvpilot.contract.checkpoint_quant import CHECKPOINT_KINDS
from kvpilot.contract.engine_config import SCHEDULING_POLICY_CHOICES
from kvpilot.contract.memory import ModelFacts
from kvpilot.contract.model_source import parse_model_uri
from kvpilot.operator import api
from kvpilot.operator.adapters import cache_fill
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.planning import planner
from kvpilot.operator.planning.inventory import NodeType
from kvpilot.operator.reconcile import manifests, model_cache

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
CONFIG = OperatorConfig(runtime_image="registry.local/kvpilot-runtime:test")
MD = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}}
H100 = NodeType(
    name="h100",
    product="NVIDIA-H100",
    gpu_memory_mib=81559,
    gpus_per_node=8,
    price_per_hour=98.0,
    node_selector={"t": "h100"},
    nodes=("n",),
    free_gpus_per_node=(8,),
)
QUANTIZATIONS = ("bf16", "int8", "int4")
KV_DTYPES = ("auto", "bf16", "fp16", "fp8")
URIS = ("hf://org/model@rev", "s3://models/org/model", "pvc://weights/model", "file:///srv/model")


def parsed_serve(container: dict[str, Any]) -> serve_config.ServeConfig:
    """What the runtime makes of the container's args (file:// checked by the parser only: the
    path exists in the pod, not here)."""
    assert_runs_under_the_images_init(container)
    command, *args = container["args"]
    assert command == "serve"
    values = vars(serve_config.build_parser().parse_args(args))
    return serve_config.ServeConfig(**values)


def assert_runs_under_the_images_init(container: dict[str, Any]) -> None:
    """No `command`: the runtime image's ENTRYPOINT runs the args, so its tini is PID 1."""
    assert "command" not in container
    assert RUNTIME.entrypoint == ("tini", "--", "kvpilot-runtime")


def parsed_fetch(container: dict[str, Any]) -> None:
    assert_runs_under_the_images_init(container)
    command, *args = container["args"]
    assert command == "fetch"
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in args)
    assert set(flags) <= {"model", "to", "summary-file"} and {"model", "to"} <= set(flags)
    with pytest.raises(SystemExit) as exit_:  # the real parser accepts them (then --help exits)
        fetch.main([*args, "--help"])
    assert exit_.value.code == 0


def plan(tp: int, quantization: str) -> planner.NodePlan:
    return planner.NodePlan(H100, True, quantization, tp, max_concurrency=8)


@pytest.mark.parametrize(
    ("tp", "quantization", "kv_dtype", "uri"),
    list(itertools.product((1, 2, 4, 8), QUANTIZATIONS, KV_DTYPES, URIS)),
)
def test_every_plan_shape_parses_in_the_runtime(
    tp: int, quantization: str, kv_dtype: str, uri: str
) -> None:
    spec = api.parse_spec({"model": {"uri": uri}, "serving": {"kvCacheDtype": kv_dtype}})
    pod = manifests.build_deployment(MD, spec, plan(tp, quantization), 1, CONFIG)
    pod_spec = pod["spec"]["template"]["spec"]
    config = parsed_serve(pod_spec["containers"][0])
    assert config.tensor_parallel_size == tp
    assert config.quantization == quantization
    assert config.kv_cache_dtype == kv_dtype
    assert config.served_name == "model"
    for init in pod_spec.get("initContainers", []):
        parsed_fetch(init)


@pytest.mark.parametrize("kind", CHECKPOINT_KINDS)
@pytest.mark.parametrize("uri", [u for u in URIS if u.startswith(("pvc://", "file://"))])
def test_a_model_planned_from_a_config_map_expects_its_checkpoint(uri: str, kind: str) -> None:
    """Planned from spec.model.configMapRef's config.json: the pod names the checkpoint kind
    planned, in a flag the runtime parses; other pods keep the args they had."""
    model = {"uri": uri, "configMapRef": {"name": "model-config"}}
    node_plan = dataclasses.replace(plan(1, "int4"), checkpoint=kind)
    for spec, expected in [
        (api.parse_spec({"model": model}), kind),
        (api.parse_spec({"model": {"uri": uri}}), None),
    ]:
        pod = manifests.build_deployment(MD, spec, node_plan, 1, CONFIG)["spec"]["template"]
        assert parsed_serve(pod["spec"]["containers"][0]).expect_checkpoint == expected


@pytest.mark.parametrize("uri", [u for u in URIS if u.startswith(("hf://", "s3://"))])
def test_a_cached_model_is_fetched_by_the_fill_job_and_served_from_the_claim(uri: str) -> None:
    spec = api.parse_spec({"model": {"uri": uri, "cache": {}}})
    job = model_cache.build_fill_job(MD, spec, plan(1, "bf16"), CONFIG)
    parsed_fetch(job["spec"]["template"]["spec"]["containers"][0])
    pod = manifests.build_deployment(MD, spec, plan(1, "bf16"), 1, CONFIG)["spec"]["template"]
    assert "initContainers" not in pod["spec"]  # nothing to fetch: the claim holds the model
    assert parsed_serve(pod["spec"]["containers"][0]).model == f"file://{manifests.MODEL_MOUNT}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses_in_the_runtime(path: Path) -> None:
    md = yaml.safe_load(path.read_text())
    spec = api.parse_spec(md["spec"])
    facts = ModelFacts(parameters=8_000_000_000, layers=32, kv_heads=8, head_dim=128)
    node_plan = planner.plan_node_type(planner.PlanRequest.from_spec(spec, facts), H100)
    md = {**md, "metadata": {**md["metadata"], "namespace": "ns", "uid": "u"}}
    pod = manifests.build_deployment(md, spec, node_plan, 1, CONFIG)["spec"]["template"]["spec"]
    config = parsed_serve(pod["containers"][0])
    assert config.served_name == api.served_name(spec.model)
    for init in pod.get("initContainers", []):
        parsed_fetch(init)


@pytest.mark.parametrize(
    ("speculative", "expected"),
    [
        (None, None),
        ({}, ("ngram", 4, 4, 2)),
        (
            {"numSpeculativeTokens": 8, "promptLookupMax": 6, "promptLookupMin": 3},
            ("ngram", 8, 6, 3),
        ),
    ],
)
def test_speculative_decoding_in_the_spec_is_the_runtimes_speculative_config(
    speculative: dict[str, Any] | None, expected: tuple[str, int, int, int] | None
) -> None:
    serving = {} if speculative is None else {"speculative": speculative}
    spec = api.parse_spec({"model": {"uri": URIS[0]}, "serving": serving})
    pod = manifests.build_deployment(MD, spec, plan(1, "bf16"), 1, CONFIG)
    runtime = parsed_serve(pod["spec"]["template"]["spec"]["containers"][0]).speculative()
    got = None if runtime is None else (
        runtime.method, runtime.num_speculative_tokens, runtime.prompt_lookup_max,
        runtime.prompt_lookup_min,
    )  # fmt: skip
    assert got == expected


@pytest.mark.parametrize("tp", [1, 2])  # with tensor parallelism the draft runs on rank 0
def test_a_draft_model_is_fetched_into_its_volume_and_named_in_the_speculative_config(
    tp: int,
) -> None:
    for served in URIS:
        speculative = {
            "method": "draft_model",
            "model": "hf://org/draft",
            "numSpeculativeTokens": 3,
        }
        serving = {"speculative": speculative}
        spec = api.parse_spec({"model": {"uri": served}, "serving": serving})
        pod = manifests.build_deployment(MD, spec, plan(tp, "bf16"), 1, CONFIG)["spec"]["template"]
        container = pod["spec"]["containers"][0]
        config = parsed_serve(container)
        assert config.tensor_parallel_size == tp
        runtime = config.speculative()
        assert runtime is not None
        assert (runtime.method, runtime.num_speculative_tokens) == ("draft_model", 3)
        *_, draft_fetch = pod["spec"]["initContainers"]
        parsed_fetch(draft_fetch)
        assert f"--model={speculative['model']}" in draft_fetch["args"]
        # what the init container writes is what the runtime reads, from a volume of the pod
        (written,) = [m for m in draft_fetch["volumeMounts"] if m["mountPath"] == runtime.model]
        (read,) = [m for m in container["volumeMounts"] if m["mountPath"] == runtime.model]
        assert written["name"] == read["name"] and read["readOnly"]
        assert {"name": read["name"], "emptyDir": {}} in pod["spec"]["volumes"]


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "eagle"},
        {"numSpeculativeTokens": 0},
        {"numSpeculativeTokens": 17},
        {"promptLookupMin": 5, "promptLookupMax": 4},
        {"promptLookupMin": 5},  # above the default max (4)
        {"model": "hf://org/draft"},
        {"method": "draft_model"},
        {"method": "draft_model", "model": "hf://org/draft", "promptLookupMax": 4},
        {"method": "draft_model", "model": "pvc://claim/draft"},
    ],
)
def test_a_speculative_spec_the_runtime_would_refuse_is_refused_at_parse(
    speculative: dict[str, Any],
) -> None:
    with pytest.raises(ValueError):
        api.parse_spec({"model": {"uri": URIS[0]}, "serving": {"speculative": speculative}})


@pytest.mark.parametrize(
    "kv_offload",
    [
        {"hostGiB": 0.5},
        {"hostGiB": 4, "disk": {"sizeGiB": 20}},
        {"hostGiB": 4, "disk": {"sizeGiB": 20, "claimName": "kv"}},
        {"hostGiB": 4, "disk": {"sizeGiB": 1.5, "hostPath": "/mnt/nvme/kv"}},
    ],
)
def test_kv_offload_in_the_spec_is_the_runtimes_kv_tiers(kv_offload: dict[str, Any]) -> None:
    for uri in URIS:
        spec = api.parse_spec({"model": {"uri": uri}, "runtime": {"kvOffload": kv_offload}})
        pod = manifests.build_deployment(MD, spec, plan(1, "bf16"), 1, CONFIG)["spec"]["template"]
        container = pod["spec"]["containers"][0]
        config = parsed_serve(container)
        assert config.kv_offloading_size == kv_offload["hostGiB"]
        disk = kv_offload.get("disk")
        if disk is None:
            assert config.kv_offloading_disk_path is None
            continue
        assert config.kv_offloading_disk_size == disk["sizeGiB"]
        # the directory the runtime writes is a writable volume of the pod
        (mount,) = [
            m for m in container["volumeMounts"] if m["mountPath"] == config.kv_offloading_disk_path
        ]
        assert not mount.get("readOnly")
        assert mount["name"] in {v["name"] for v in pod["spec"]["volumes"]}


ADAPTERS: list[dict[str, Any]] = [
    {"name": "sql", "uri": "hf://org/sql-lora@v2"},
    {"name": "tenant/support", "uri": "s3://adapters/support", "secretRef": {"name": "s3"}},
    {"name": "local.v1", "uri": "file:///srv/adapters/local"},
]


@pytest.mark.parametrize("uri", URIS)
def test_adapters_in_the_spec_give_the_runtimes_lora_flags(uri: str) -> None:
    lora = {"maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 8}
    spec = api.parse_spec({"model": {"uri": uri}, "adapters": ADAPTERS, "lora": lora})
    pod = manifests.build_deployment(MD, spec, plan(1, "bf16"), 1, CONFIG)["spec"]["template"]
    container = pod["spec"]["containers"][0]
    config = parsed_serve(container)
    assert config.enable_lora
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (4, 64, 8)
    assert config.lora_adapters == []  # loaded through the API (adapters/sync.py)
    # the runtime fetches hf:// and s3:// adapters itself, with the adapters' Secret
    assert container["envFrom"] == [{"secretRef": {"name": "s3"}}]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env[serve_config.LORA_RUNTIME_UPDATES_ENV] == "true"


def test_without_adapters_or_lora_the_pod_has_no_lora_flags() -> None:
    spec = api.parse_spec({"model": {"uri": URIS[0]}})
    pod = manifests.build_deployment(MD, spec, plan(1, "bf16"), 1, CONFIG)["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert not parsed_serve(container).enable_lora
    assert "envFrom" not in container
    assert serve_config.LORA_RUNTIME_UPDATES_ENV not in {e["name"] for e in container["env"]}


def test_lora_alone_gives_the_default_slots_and_no_adapter() -> None:
    spec = api.parse_spec({"model": {"uri": URIS[0]}, "lora": {}})
    pod = manifests.build_deployment(MD, spec, plan(1, "bf16"), 1, CONFIG)["spec"]["template"]
    config = parsed_serve(pod["spec"]["containers"][0])
    assert config.enable_lora and config.lora_adapters == []
    assert (config.max_loras, config.max_lora_rank) == (api.DEFAULT_MAX_LORAS, 16)


def test_adapters_fetched_with_two_secrets_are_refused_naming_both() -> None:
    adapters = [
        {"name": "a", "uri": "hf://org/a", "secretRef": {"name": "one"}},
        {"name": "b", "uri": "hf://org/b"},  # spec.model's Secret
    ]
    with pytest.raises(ValueError, match="Secrets one, two"):
        api.parse_spec(
            {"model": {"uri": URIS[0], "secretRef": {"name": "two"}}, "adapters": adapters}
        )


def test_the_runtime_reads_the_switch_the_operator_sets() -> None:
    from kvpilot.runtime.server import lora_serving  # the runtime's side of the contract

    assert lora_serving.RUNTIME_UPDATES_ENV == serve_config.LORA_RUNTIME_UPDATES_ENV
    assert lora_serving.runtime_updates_allowed({serve_config.LORA_RUNTIME_UPDATES_ENV: "true"})


def test_adding_or_removing_adapters_leaves_the_pod_template_as_it_was() -> None:
    # a changed template would roll every pod: adapters come and go through the runtime's API
    def template(adapters: list[dict[str, Any]]) -> Any:
        spec = api.parse_spec({"model": {"uri": URIS[0]}, "lora": {}, "adapters": adapters})
        return manifests.build_deployment(MD, spec, plan(1, "bf16"), 1, CONFIG)["spec"]["template"]

    public = [a for a in ADAPTERS if "secretRef" not in a]
    assert template([]) == template(public[:1]) == template(public)


@pytest.mark.parametrize(
    ("serving", "policy", "flag"),
    [
        ({}, "fcfs", None),  # the runtime's default: no flag, so existing pods do not roll
        ({"schedulingPolicy": "fcfs"}, "fcfs", None),
        ({"schedulingPolicy": "priority"}, "priority", "--scheduling-policy=priority"),
    ],
)
def test_the_scheduling_policy_is_the_runtimes(
    serving: dict[str, Any], policy: str, flag: str | None
) -> None:
    spec = api.parse_spec({"model": {"uri": URIS[0]}, "serving": serving})
    container = manifests.build_deployment(MD, spec, plan(1, "bf16"), 1, CONFIG)["spec"][
        "template"
    ]["spec"]["containers"][0]
    assert parsed_serve(container).scheduling_policy == policy
    written = [a for a in container["args"] if a.startswith("--scheduling-policy")]
    assert written == ([] if flag is None else [flag])


def test_the_specs_policies_are_the_runtimes_and_no_other_is_accepted() -> None:
    assert typing.get_args(api.SchedulingPolicy) == SCHEDULING_POLICY_CHOICES
    with pytest.raises(ValueError, match="schedulingPolicy"):
        api.parse_spec({"model": {"uri": URIS[0]}, "serving": {"schedulingPolicy": "lifo"}})


@pytest.mark.parametrize("uri", [u for u in URIS if u.startswith(("hf://", "s3://"))])
def test_with_the_model_cache_adapters_are_fetched_into_it_and_read_from_the_pods_mount(
    uri: str,
) -> None:
    """The adapter fill Job writes where the runtime's --lora-cache-dir looks for the entry,
    inside the claim the pod mounts."""
    spec = api.parse_spec(
        {"model": {"uri": uri, "cache": {}}, "adapters": ADAPTERS, "lora": {"maxLoras": 2}}
    )
    model_job = model_cache.build_fill_job(MD, spec, plan(1, "bf16"), CONFIG)
    pod = manifests.build_deployment(MD, spec, plan(1, "bf16"), 1, CONFIG)["spec"]["template"]
    dirs = parsed_serve(pod["spec"]["containers"][0]).adapter_dirs
    assert cache_fill.cached_uris(spec) == [ADAPTERS[0]["uri"], ADAPTERS[1]["uri"]]  # not file://
    for adapter in ADAPTERS[:2]:
        job = cache_fill.build_job(MD, spec, adapter["uri"], model_job)
        fill = job["spec"]["template"]["spec"]["containers"][0]
        parsed_fetch(fill)
        to = next(a.removeprefix("--to=") for a in fill["args"] if a.startswith("--to="))
        assert to == dirs.cache_entry(adapter["uri"])
        (mount,) = [m for m in fill["volumeMounts"] if to.startswith(m["mountPath"] + "/")]
        claim = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
        assert claim["persistentVolumeClaim"]["claimName"] == manifests.cache_claim_name(uri)
        assert (
            next(
                v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
            )["persistentVolumeClaim"]["claimName"]
            == claim["persistentVolumeClaim"]["claimName"]
        )
    secret = cache_fill.build_job(MD, spec, ADAPTERS[1]["uri"], model_job)
    assert secret["spec"]["template"]["spec"]["containers"][0]["envFrom"] == [
        {"secretRef": {"name": "s3"}}
    ]


def test_without_the_model_cache_the_runtime_looks_in_no_cache() -> None:
    spec = api.parse_spec({"model": {"uri": URIS[0]}, "adapters": ADAPTERS})
    pod = manifests.build_deployment(MD, spec, plan(1, "bf16"), 1, CONFIG)["spec"]["template"]
    assert parsed_serve(pod["spec"]["containers"][0]).lora_cache_dir is None
    assert cache_fill.cached_uris(spec) == []


def test_pvc_adapters_claims_are_mounted_read_only_where_the_runtime_reads_them() -> None:
    adapters = [
        {"name": "a", "uri": "pvc://loras/tenant-a"},
        {"name": "b", "uri": "pvc://loras/tenant-b"},  # one claim, one mount
        {"name": "c", "uri": "pvc://other-loras"},
        {"name": "d", "uri": "hf://org/d"},
    ]
    spec = api.parse_spec({"model": {"uri": URIS[0]}, "adapters": adapters})
    pod = manifests.build_deployment(MD, spec, plan(1, "bf16"), 1, CONFIG)["spec"]["template"]
    container = pod["spec"]["containers"][0]
    dirs = parsed_serve(container).adapter_dirs
    claims = {
        v["name"]: v["persistentVolumeClaim"]
        for v in pod["spec"]["volumes"]
        if v["name"].startswith("lora-claim-")
    }
    assert sorted(c["claimName"] for c in claims.values()) == ["loras", "other-loras"]
    assert all(c["readOnly"] for c in claims.values())
    mounts = {m["mountPath"]: m for m in container["volumeMounts"] if m["name"] in claims}
    for adapter in adapters[:3]:
        source = parse_model_uri(adapter["uri"])
        path = adapter_cache.claim_path(dirs.claims, source)
        (mount,) = [m for p, m in mounts.items() if (path + "/").startswith(p + "/")]
        assert mount["readOnly"] and claims[mount["name"]]["claimName"] == source.location
    # the local pool's pod runner rewrites the flag's directories to the claims' directories
    as_run = {"metadata": {"namespace": "ns"}, "spec": pod["spec"]}
    local = podrunner_pods.volume_dirs(as_run, Path("/pod"), Path("/claims"))
    rewritten = [
        podrunner_pods.rewrite_paths(arg, podrunner_pods.container_mounts(container, local))
        for arg in container["args"]
        if arg.startswith("--lora-claims=")
    ]
    assert rewritten == [
        "--lora-claims=loras=/claims/ns/loras",
        "--lora-claims=other-loras=/claims/ns/other-loras",
    ]


def test_without_pvc_adapters_no_claim_is_mounted() -> None:
    spec = api.parse_spec({"model": {"uri": URIS[0]}, "adapters": ADAPTERS})
    pod = manifests.build_deployment(MD, spec, plan(1, "bf16"), 1, CONFIG)["spec"]["template"]
    assert not any(v["name"].startswith("lora-claim-") for v in pod["spec"]["volumes"])
    assert parsed_serve(pod["spec"]["containers"][0]).lora_claims == ()
