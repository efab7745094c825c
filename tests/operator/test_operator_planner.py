"""Planner tables. Every expected figure is computed by hand in the test, from DESIGN.md §3.3:

weights  = parameters x bytes_per_param(q)          bf16 2, int8 1, int4 0.5 + 4/128
kv       = 2 x layers x kv_heads x head_dim x 2 bytes x tokens x sequences
per GPU  = (weights + kv) / tp + 1 GiB + 5% of weights per GPU
usable   = gpu.memory MiB x 2^20 x 0.9
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvpilot.contract import catalog
from kvpilot.contract.memory import GIB, ModelFacts
from kvpilot.operator import api
from kvpilot.operator.planning import planner
from kvpilot.operator.planning.inventory import NodeType

GB = 1e9
SEVEN_B = ModelFacts(parameters=7_000_000_000, layers=32, kv_heads=8, head_dim=128)
SEVENTY_B = ModelFacts(parameters=70_000_000_000, layers=80, kv_heads=8, head_dim=128)
LLAMA_70B = catalog.lookup("hf://meta-llama/Llama-3.1-70B-Instruct")


def pool(name: str, mib: int, gpus: int, nodes: int = 1, price: float = 1.0) -> NodeType:
    return NodeType(
        name=name,
        product="",
        gpu_memory_mib=mib,
        gpus_per_node=gpus,
        price_per_hour=price,
        node_selector={"kvpilot.dev/node-type": name},
        nodes=tuple(f"{name}-{i}" for i in range(nodes)),
        free_gpus_per_node=(gpus,) * nodes,
    )


# The dev cluster's pools (hack/nodepools.yaml).
H100 = pool("h100-80gb", 81559, 8, 2, 98.32)
A100 = pool("a100-40gb", 40960, 4, 2, 16.39)
L4 = pool("l4-24gb", 23034, 1, 3, 0.98)
L4X4 = pool("l4x4-24gb", 23034, 4, 1, 4.89)
T4 = pool("t4-16gb", 15360, 1, 2, 0.53)
DEV_POOLS = [H100, A100, L4, L4X4, T4]


def request(facts: ModelFacts = SEVEN_B, **overrides: Any) -> planner.PlanRequest:
    fields: dict[str, Any] = {
        "facts": facts,
        "quantizations": ("bf16", "int8", "int4"),
        "max_context_length": 8192,
        "target_concurrency": 8,
    }
    fields.update(overrides)
    return planner.PlanRequest(**fields)


BIG = pool("big", 1024 * 1024, 8)  # 1 TiB per GPU: everything fits at tp 1, weights are unsplit


@pytest.mark.parametrize(
    ("facts", "quantization", "expected_gb"),
    [
        (SEVEN_B, "bf16", 14.0),
        (SEVEN_B, "int8", 7.0),
        (SEVEN_B, "int4", 3.5 * (1 + 4 / 64)),
        (SEVENTY_B, "bf16", 140.0),
        (SEVENTY_B, "int4", 35.0 * (1 + 4 / 64)),
    ],
)
def test_weights_match_the_rule_of_thumb(
    facts: ModelFacts, quantization: str, expected_gb: float
) -> None:
    plan = planner.plan_node_type(request(facts, quantizations=(quantization,)), BIG)
    assert plan.fits and plan.tensor_parallel == 1
    assert plan.estimate is not None
    # int4 carries a 16-bit scale and zero per 128 weights: 4/128 of a byte per weight.
    assert plan.estimate.weights_bytes / GB == pytest.approx(expected_gb, rel=0.035)


def test_doubling_context_or_concurrency_doubles_the_kv_term() -> None:
    base = planner.plan_node_type(request(max_context_length=4096), BIG).estimate
    longer = planner.plan_node_type(request(max_context_length=8192), BIG).estimate
    wider = planner.plan_node_type(
        request(max_context_length=4096, target_concurrency=16), BIG
    ).estimate
    assert base and longer and wider
    assert longer.kv_cache_bytes == 2 * base.kv_cache_bytes
    assert wider.kv_cache_bytes == 2 * base.kv_cache_bytes
    # 7B figures: 2 x 32 x 8 x 128 x 2 B = 128 KiB per token; 4096 x 8 tokens = 4 GiB.
    assert base.kv_cache_bytes == 4 * GIB
    assert longer.weights_bytes == base.weights_bytes


def _by_hand_per_gpu_gib(parameters: int, bytes_per_param: float, tp: int) -> float:
    """Llama-3.1-70B, 8192 tokens x 8 sequences: KV = 2*80*8*128*2 B * 65536 = 20 GiB exactly."""
    weights = parameters * bytes_per_param / tp / GIB
    return weights + 20 / tp + 1 + 0.05 * weights


def test_llama_70b_on_the_dev_pools() -> None:
    assert LLAMA_70B is not None
    p = LLAMA_70B.parameters
    plans = {x.node_type.name: x for x in planner.plan(request(LLAMA_70B), DEV_POOLS)}

    # H100-80GB (71.68 GiB usable): bf16 at tp 2 needs 80.0 GiB, at tp 4 40.5 GiB -> bf16, tp 4.
    h100_usable = 81559 * 0.9 / 1024
    assert _by_hand_per_gpu_gib(p, 2, 2) > h100_usable > _by_hand_per_gpu_gib(p, 2, 4)
    assert (plans["h100-80gb"].quantization, plans["h100-80gb"].tensor_parallel) == ("bf16", 4)

    # A100-40GB (36 GiB usable, 4 GPUs per node): bf16 even at tp 4 needs 40.5 GiB; int8 at tp 2
    # needs 45.5 GiB; int8 at tp 4 needs 23.2 GiB -> int8 is the best level within one node.
    a100_usable = 40960 * 0.9 / 1024
    assert _by_hand_per_gpu_gib(p, 2, 4) == pytest.approx(40.5, abs=0.05)
    assert _by_hand_per_gpu_gib(p, 2, 4) > a100_usable
    assert _by_hand_per_gpu_gib(p, 1, 2) > a100_usable > _by_hand_per_gpu_gib(p, 1, 4)
    assert (plans["a100-40gb"].quantization, plans["a100-40gb"].tensor_parallel) == ("int8", 4)

    # T4-16GB: one GPU; int4 alone is 34.9 GiB of weights, far above 13.5 GiB usable.
    t4 = plans["t4-16gb"]
    assert not t4.fits
    assert t4.reason == (
        "t4-16gb: int4 needs 57.7 GiB per GPU (weights 34.9 + KV 20.0 + overhead 2.7)"
        " > 13.5 GiB usable"
    )
    assert _by_hand_per_gpu_gib(p, 0.5 + 4 / 128, 1) == pytest.approx(57.65, abs=0.01)
    # Quality order: bf16 first, then int8, then int4 on the 4-GPU L4 node; misfits last.
    assert [x.node_type.name for x in planner.plan(request(LLAMA_70B), DEV_POOLS)] == [
        "h100-80gb",
        "a100-40gb",
        "l4x4-24gb",
        "l4-24gb",
        "t4-16gb",
    ]


def test_fitting_plan_reports_max_concurrency_at_full_context() -> None:
    plan = planner.plan_node_type(request(), H100)
    assert plan.estimate is not None
    # bf16 7B on one H100: usable 71.68 GiB - weights 13.04 - overhead 1.65 = 56.99 GiB of KV;
    # one 8192-token sequence is 1 GiB, so 56 whole sequences.
    budget_gib = 81559 * 0.9 / 1024 - 14e9 / GIB - (1 + 0.05 * 14e9 / GIB)
    assert plan.max_concurrency == int(budget_gib) == 56


@pytest.mark.parametrize(
    ("overrides", "node_type", "expected"),
    [
        ({}, L4, ("int8", 1)),  # bf16 14 GB + 8 GiB KV > 20.2 GiB; int8 fits
        ({"quantizations": ("int4", "bf16")}, L4, ("int4", 1)),  # the user's order, not ours
        ({"max_gpus_per_replica": 1}, L4X4, ("int8", 1)),  # bf16 would need tp 2
        ({}, L4X4, ("bf16", 2)),
        ({"kv_bytes": 1}, L4, ("bf16", 1)),  # fp8 KV halves the 8 GiB: 13.04 + 4 + 1.65 fits
        # 13.5 GiB usable: int8 needs 6.52 + 8 + 1.33 = 15.85, int4 3.36 + 8 + 1.17 = 12.53
        ({"gpu_memory_utilization": 0.6}, L4, ("int4", 1)),
    ],
)
def test_choice_per_node_type(
    overrides: dict[str, Any], node_type: NodeType, expected: tuple[str, int]
) -> None:
    plan = planner.plan_node_type(request(**overrides), node_type)
    assert plan.fits
    assert (plan.quantization, plan.tensor_parallel) == expected


def test_prefer_cost_orders_by_price_per_sequence() -> None:
    quality = [p.node_type.name for p in planner.plan(request(), DEV_POOLS)]
    cost = [p.node_type.name for p in planner.plan(request(prefer="cost"), DEV_POOLS)]
    # quality: every bf16 type before any int8/int4 one, the cheaper replica first:
    # l4x4 at tp 2 ($2.45/h), a100 at tp 1 ($4.10/h), h100 at tp 1 ($12.29/h).
    assert quality == ["l4x4-24gb", "a100-40gb", "h100-80gb", "l4-24gb", "t4-16gb"]
    # cost, $ per hour per sequence held at full context (1 GiB of KV per sequence):
    # t4 int4 0.53/8 = 0.066; l4 int8 0.98/12 = 0.082; l4x4 bf16 2.445/24 = 0.102;
    # a100 bf16 4.10/21 = 0.195; h100 bf16 12.29/56 = 0.219.
    assert cost == ["t4-16gb", "l4-24gb", "l4x4-24gb", "a100-40gb", "h100-80gb"]


@pytest.mark.parametrize(
    ("measured", "expected"),
    [
        # nothing measured: the estimate's order (above)
        ({}, ["t4-16gb", "l4-24gb", "l4x4-24gb", "a100-40gb", "h100-80gb"]),
        # t4 and l4 measured ($/1k requests): l4 is cheaper on real traffic, so it goes first.
        # Ratios measured/estimate: t4 0.53/0.06625 = 8, l4 0.49/0.081667 = 6; median 7, so
        # l4x4 0.1019 x 7 = 0.71, a100 0.1951 x 7 = 1.37, h100 0.2195 x 7 = 1.54 stay behind.
        (
            {"t4-16gb": 0.53, "l4-24gb": 0.49},
            ["l4-24gb", "t4-16gb", "l4x4-24gb", "a100-40gb", "h100-80gb"],
        ),
        # h100 measured far below its estimate's place (ratio 0.11/0.2195 = 0.5): it goes first;
        # the median ratio of 8, 6 and 0.5 is 6, so l4x4 0.1019 x 6 = 0.61 comes after t4's
        # measured 0.53, and a100 0.1951 x 6 = 1.17 last.
        (
            {"t4-16gb": 0.53, "l4-24gb": 0.49, "h100-80gb": 0.11},
            ["h100-80gb", "l4-24gb", "t4-16gb", "l4x4-24gb", "a100-40gb"],
        ),
        # one measurement calibrates the unit only: the estimate's order
        ({"a100-40gb": 3.0}, ["t4-16gb", "l4-24gb", "l4x4-24gb", "a100-40gb", "h100-80gb"]),
        # a node type not in the plan, or with no traffic (null): ignored
        (
            {"v100-16gb": 0.01, "t4-16gb": 0.0},
            ["t4-16gb", "l4-24gb", "l4x4-24gb", "a100-40gb", "h100-80gb"],
        ),
    ],
)
def test_prefer_cost_ranks_by_measured_cost_per_request_where_it_exists(
    measured: dict[str, float], expected: list[str]
) -> None:
    asked = request(prefer="cost", measured_cost=tuple(measured.items()))
    assert [p.node_type.name for p in planner.plan(asked, DEV_POOLS)] == expected


def test_prefer_quality_ignores_measured_cost() -> None:
    measured = (("t4-16gb", 0.01), ("h100-80gb", 0.001))
    quality = [p.node_type.name for p in planner.plan(request(measured_cost=measured), DEV_POOLS)]
    assert quality == ["l4x4-24gb", "a100-40gb", "h100-80gb", "l4-24gb", "t4-16gb"]


def test_named_node_types_only_and_unknown_names_reported() -> None:
    plans = planner.plan(request(node_types=("t4-16gb", "gb200")), DEV_POOLS)
    assert [p.node_type.name for p in plans] == ["t4-16gb", "gb200"]
    assert plans[1].reason == "gb200: no such node type in the cluster"


@pytest.mark.parametrize(
    ("total", "free", "expected"),
    [
        (3, [2, 5], [2, 1]),  # first type fills up, the rest spills to the next
        (1, [2, 5], [1, 0]),
        (9, [2, 5], [4, 5]),  # no room anywhere: the excess waits on the first type
        (0, [2, 5], [0, 0]),
        (2, [0, 0], [2, 0]),
    ],
)
def test_assign_replicas(total: int, free: list[int], expected: list[int]) -> None:
    plans = [
        planner.NodePlan(
            pool(f"p{i}", 80000, n, 1) if n else pool(f"p{i}", 80000, 1, 0), True, "bf16", 1
        )
        for i, n in enumerate(free)
    ]
    assert planner.assign_replicas(total, plans) == expected


def test_request_rejects_empty_quantizations() -> None:
    with pytest.raises(ValueError, match=r"quantization\.allowed is empty"):
        request(quantizations=())


@pytest.mark.parametrize(
    ("kv_heads", "gpus", "min_gpus", "max_gpus", "expected"),
    [
        (8, 8, 1, 8, [1, 2, 4, 8]),
        (8, 8, 2, 8, [2, 4, 8]),  # minGpusPerReplica: tensor parallel for latency
        (8, 8, 1, 2, [1, 2]),
        (4, 8, 1, 8, [1, 2, 4]),  # 8 ranks cannot split 4 KV heads: the runtime would refuse
        (2, 4, 4, 8, []),
        (8, 1, 2, 8, []),
    ],
)
def test_tp_degrees(
    kv_heads: int, gpus: int, min_gpus: int, max_gpus: int, expected: list[int]
) -> None:
    facts = ModelFacts(parameters=1_000_000, layers=2, kv_heads=kv_heads, head_dim=64)
    req = request(facts, min_gpus_per_replica=min_gpus, max_gpus_per_replica=max_gpus)
    assert planner.tp_degrees(req, pool("p", 81559, gpus)) == expected


@pytest.mark.parametrize(
    ("kv_heads", "gpus", "min_gpus", "reason"),
    [
        (8, 1, 2, "p: 1 GPUs per node, minGpusPerReplica is 2"),
        (2, 4, 4, "p: no tensor-parallel degree in 4..4 divides the model's 2 KV heads"),
    ],
)
def test_no_degree_says_why(kv_heads: int, gpus: int, min_gpus: int, reason: str) -> None:
    facts = ModelFacts(parameters=1_000_000, layers=2, kv_heads=kv_heads, head_dim=64)
    plan = planner.plan_node_type(
        request(facts, min_gpus_per_replica=min_gpus), pool("p", 81559, gpus)
    )
    assert not plan.fits and plan.reason == reason


# A 0.5B draft beside the 7B: 16 layers x 2 KV heads x 64 per token, 1/16 of the 7B's 32 x 8 x 128.
DRAFT = ModelFacts(parameters=500_000_000, layers=16, kv_heads=2, head_dim=64)


def test_a_draft_model_adds_its_bf16_weights_and_its_share_of_every_kv_block() -> None:
    alone = planner.plan_node_type(request(quantizations=("int8",)), BIG).estimate
    drafted = planner.plan_node_type(request(quantizations=("int8",), draft=DRAFT), BIG).estimate
    assert alone and drafted
    # the draft is loaded unquantised (bf16, 2 bytes a parameter) whatever the served level
    assert drafted.weights_bytes - alone.weights_bytes == 500_000_000 * 2
    assert drafted.kv_cache_bytes == alone.kv_cache_bytes * (1 + 1 / 16)


def test_a_draft_model_holds_fewer_sequences_in_the_same_budget() -> None:
    alone = planner.plan_node_type(request(), H100)
    drafted = planner.plan_node_type(request(draft=DRAFT), H100)
    # the KV budget shrinks by the draft's 1 GB of weights (and 5% of them in overhead), and
    # each sequence costs 1 + 1/16 of its blocks
    budget_gib = 81559 * 0.9 / 1024 - 15e9 / GIB - (1 + 0.05 * 15e9 / GIB)
    assert (alone.max_concurrency, drafted.max_concurrency) == (56, int(budget_gib / (17 / 16)))


def test_a_draft_model_runs_on_gpu_0_beside_its_shard_of_the_served_model() -> None:
    """With tensor parallelism the draft is whole on rank 0 (the runtime's), so GPU 0, the
    fullest, is what the estimate holds: half the served model's weights and KV, all the
    draft's."""
    assert planner.tp_degrees(request(draft=DRAFT), L4X4) == planner.tp_degrees(request(), L4X4)
    alone = planner.plan_node_type(request(), L4X4)
    drafted = planner.plan_node_type(request(draft=DRAFT), L4X4)
    assert (drafted.quantization, drafted.tensor_parallel) == ("bf16", 2)
    assert (alone.quantization, alone.tensor_parallel) == ("bf16", 2)
    assert alone.estimate and drafted.estimate
    assert drafted.estimate.weights_bytes - alone.estimate.weights_bytes == 500_000_000 * 2
    # per token on GPU 0: half the 7B's KV and all the draft's (1/16 of the 7B's, 1/8 of half)
    assert drafted.estimate.kv_cache_bytes == alone.estimate.kv_cache_bytes * (1 + 2 / 16)


def with_memory(node_type: NodeType, gib: float) -> NodeType:
    return dataclasses.replace(node_type, memory_bytes=int(gib * GIB))


@pytest.mark.parametrize(
    ("runtime", "node_gib", "fits", "reason"),
    [
        ({"kvOffload": {"hostGiB": 16}}, 32, True, ""),
        ({"kvOffload": {"hostGiB": 16}}, 0, True, ""),  # node memory unknown: not counted
        (
            {"kvOffload": {"hostGiB": 48}},
            32,
            False,
            "l4-24gb: a replica requests 48.0 GiB of memory with runtime.kvOffload's host tier,"
            " its nodes have 32.0 GiB",
        ),
        (
            {"kvOffload": {"hostGiB": 24}, "resources": {"requests": {"memory": "10Gi"}}},
            32,
            False,
            "l4-24gb: a replica requests 34.0 GiB of memory with runtime.kvOffload's host tier,"
            " its nodes have 32.0 GiB",
        ),
        (
            {"resources": {"requests": {"memory": "40Gi"}}},
            32,
            False,
            "l4-24gb: a replica requests 40.0 GiB of memory, its nodes have 32.0 GiB",
        ),
    ],
)
def test_the_host_tier_and_memory_request_are_counted_against_node_memory(
    runtime: dict[str, Any], node_gib: float, fits: bool, reason: str
) -> None:
    spec = api.parse_spec({"model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}, "runtime": runtime})
    req = planner.PlanRequest.from_spec(spec, SEVEN_B)
    plan = planner.plan_node_type(req, with_memory(L4, node_gib))
    assert (plan.fits, plan.reason if not fits else "") == (fits, reason)


def test_kv_offload_plans_one_gpu_per_replica_and_says_so_when_that_misses() -> None:
    def plan_70b(runtime: dict[str, Any]) -> planner.NodePlan:
        spec = api.parse_spec(
            {"model": {"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"},
             "quantization": {"allowed": ["bf16"]}, "runtime": runtime}
        )  # fmt: skip
        assert LLAMA_70B is not None
        return planner.plan_node_type(planner.PlanRequest.from_spec(spec, LLAMA_70B), H100)

    assert (plan_70b({}).fits, plan_70b({}).tensor_parallel) == (True, 4)
    tiered = plan_70b({"kvOffload": {"hostGiB": 64}})
    assert not tiered.fits and tiered.tensor_parallel == 1
    assert tiered.reason.endswith("(with runtime.kvOffload a replica has one GPU)")


def test_a_plan_holds_no_more_replicas_per_node_than_its_memory() -> None:
    spec = api.parse_spec(
        {
            "model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"},
            "runtime": {"kvOffload": {"hostGiB": 700}},
        }
    )
    plan = planner.plan_node_type(
        planner.PlanRequest.from_spec(spec, SEVEN_B), with_memory(H100, 1800)
    )
    assert plan.fits and plan.memory_bytes == 700 * GIB
    assert plan.num_free_slots() == 2 * H100.num_nodes  # 2 x 700 GiB per 1800 GiB node, not 8
    assert planner.assign_replicas(10, [plan]) == [10]  # the rest waits Pending, in sight


@pytest.mark.parametrize(
    ("runtime", "named"),
    [
        ({"resources": {"requests": {"memory": "lots"}}}, "requests"),
        ({"resources": {"limits": {"memory": "lots"}}, "kvOffload": {"hostGiB": 1}}, "limits"),
    ],
)
def test_a_memory_figure_that_is_not_a_quantity_is_named(
    runtime: dict[str, Any], named: str
) -> None:
    spec = api.parse_spec({"model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}, "runtime": runtime})
    with pytest.raises(ValueError, match=rf"{named}\.memory 'lots' is not a Kubernetes quantity"):
        planner.PlanRequest.from_spec(spec, SEVEN_B)


LLAMA_8B = catalog.lookup("hf://meta-llama/Llama-3.1-8B-Instruct")


@pytest.mark.parametrize(
    ("lora", "expected_slot_bytes"),
    [
        (None, 0),
        # 4 slots x rank 16 x 32 layers x 2 bytes x (7h + 2q + 2kv + 3i), h = q = 4096,
        # kv = 1024, i = 14336
        ({}, 1 * 16 * 32 * 2 * (7 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336)),
        ({"maxLoras": 4, "maxLoraRank": 64}, 4 * 64 * 32 * 2 * (9 * 4096 + 2 * 1024 + 3 * 14336)),
    ],
)
def test_adapter_slots_count_as_weights(
    lora: dict[str, Any] | None, expected_slot_bytes: int
) -> None:
    from kvpilot.operator import api

    assert LLAMA_8B is not None
    body: dict[str, Any] = {"model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"}}
    if lora is not None:
        body["lora"] = lora
    req = planner.PlanRequest.from_spec(api.parse_spec(body), LLAMA_8B)
    assert req.lora_bytes == expected_slot_bytes
    got = planner.plan_node_type(req, BIG)
    without = planner.plan_node_type(request(LLAMA_8B, max_context_length=4096), BIG)
    assert got.estimate is not None and without.estimate is not None
    assert got.estimate.weights_bytes == without.estimate.weights_bytes + expected_slot_bytes


def test_adapters_run_under_tensor_parallelism_with_their_slots_on_every_gpu() -> None:
    assert LLAMA_70B is not None
    with_lora = request(LLAMA_70B, lora_bytes=GIB)
    assert planner.tp_degrees(with_lora, H100) == planner.tp_degrees(request(LLAMA_70B), H100)
    assert planner.tp_degrees(with_lora, H100) == [1, 2, 4, 8]
    # 70B at int4 beside 1 GiB of slots on A100 40 GB: fits on 2 GPUs, each holding the slots
    verdict = planner.plan_node_type(with_lora, A100)
    without = planner.plan_node_type(request(LLAMA_70B), A100)
    assert verdict.fits and without.fits
    assert verdict.estimate is not None and without.estimate is not None
    assert verdict.tensor_parallel == without.tensor_parallel
    assert verdict.estimate.weights_bytes == without.estimate.weights_bytes + GIB
