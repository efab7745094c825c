"""Real evaluation and benchmark clients against a real `kvpilot-runtime serve` on tiny-llama.

- lm-eval (lm-evaluation-harness) with its `local-completions` model: a loglikelihood task
  (multiple choice: echo + logprobs over token-id prompts) and a generate-until task, both defined
  on small local JSONL files (no hub), the tokenizer read from the model directory. The
  loglikelihoods must be transformers' on the same tokens, the generations those the official
  openai client gets for the same prompts.
- guidellm: a short concurrent run with the local tokenizer that completes with zero errors and
  the token counts it asked for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.server_process import MODEL, TINY, RuntimeServer

pytestmark = pytest.mark.slow  # starts runtime processes or loads a model

# The tiny model was trained on Python's documentation (models/tiny-llama).
MULTIPLE_CHOICE: list[dict[str, Any]] = [
    {"question": "When a name is not bound, an attempt to evaluate it raises a",
     "choices": [" \"NameError\" exception.", " banana split.", " purple elephant."], "answer": 0},
    {"question": "An identifier occurring as an atom is a",
     "choices": [" name.", " fish.", " Tuesday."], "answer": 0},
    {"question": "Once upon a time", "choices": [" of the", " zebra"], "answer": 1},
]  # fmt: skip
GENERATE = [
    {"question": "Once upon a time", "answer": " of the"},
    {"question": "Tom and Lily", "answer": ", and the"},
    {"question": "The list of numbers:", "answer": "1"},
]
MAX_GEN_TOKS = 8
LOGLIKELIHOOD_ABS_TOL = 0.02  # float32 sums over a few tokens; a token off by one moves it by units


def write_tasks(root: Path) -> Path:
    """Two lm-eval task YAMLs over local JSONL files (the `json` loader of `datasets`)."""
    for name, rows in (("mc", MULTIPLE_CHOICE), ("gen", GENERATE)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: '{{question}}'\n"
    (root / "kvpilot_ll.yaml").write_text(
        f"task: kvpilot_ll\n{common}"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "target_delimiter: ''\n"  # the choices start with their own space
        "metric_list:\n  - metric: acc\n"
    )
    (root / "kvpilot_gen.yaml").write_text(
        f"task: kvpilot_gen\n{common}"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
        f'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: {MAX_GEN_TOKS}\n'  # YAML escapes
        "metric_list:\n  - metric: exact_match\n"
        "    aggregation: mean\n    higher_is_better: true\n"
    )
    return root


@pytest.fixture(scope="module")
def server(start_server: Callable[..., RuntimeServer]) -> RuntimeServer:
    """float32, as the transformers reference the loglikelihoods are compared with: `--dtype
    auto` computes this bf16 checkpoint in bf16 on a CPU with bf16 units, which moves a sum of
    a few tokens' logprobs by more than the tolerance (0.023 measured)."""
    return start_server("--max-model-len", "512", "--max-num-seqs", "8", "--dtype", "float32")


@pytest.fixture(scope="module")
def lm_eval_results(
    server: RuntimeServer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_DATASETS_OFFLINE", "1")
        import lm_eval
        from lm_eval.tasks import TaskManager

        tasks = TaskManager(include_path=str(write_tasks(tmp_path_factory.mktemp("lm_eval"))))
        model_args = {
            "model": MODEL,
            "base_url": f"{server.url}/v1/completions",
            "tokenizer": str(TINY),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,  # token-id prompts, as lm-eval's default
            "num_concurrent": 2,
            "max_retries": 1,
            "max_length": 512,
        }
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=["kvpilot_ll", "kvpilot_gen"],
            task_manager=tasks,
            log_samples=True,
        )
    assert results is not None
    return results


def continuation_loglikelihood(context: str, continuation: str) -> tuple[float, bool]:
    """transformers' (sum of logprobs, is greedy) of `continuation` after `context`, on the
    tokens lm-eval scores: the pair encoded whole without BOS, the context's tokens first."""
    tok = AutoTokenizer.from_pretrained(TINY)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    num_context = len(tok(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logprobs = model(torch.tensor([whole])).logits[0].log_softmax(-1)
    positions = range(num_context, len(whole))
    total = sum(float(logprobs[i - 1, whole[i]]) for i in positions)
    is_greedy = all(int(logprobs[i - 1].argmax()) == whole[i] for i in positions)
    return total, is_greedy


@pytest.mark.slow
def test_lm_eval_loglikelihood_matches_transformers(lm_eval_results: dict[str, Any]) -> None:
    samples = sorted(lm_eval_results["samples"]["kvpilot_ll"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MULTIPLE_CHOICE)
    num_correct = 0
    for sample, row in zip(samples, MULTIPLE_CHOICE, strict=True):
        theirs = [resp[0] for resp in sample["resps"]]  # one (loglikelihood, is_greedy) each
        ours = [continuation_loglikelihood(row["question"], c) for c in row["choices"]]
        for (ll, greedy), (want_ll, want_greedy) in zip(theirs, ours, strict=True):
            assert ll == pytest.approx(want_ll, abs=LOGLIKELIHOOD_ABS_TOL), (row, theirs, ours)
            assert greedy == want_greedy, (row, theirs, ours)
        best = max(range(len(ours)), key=lambda i: ours[i][0])
        num_correct += best == row["answer"]
    accuracy = lm_eval_results["results"]["kvpilot_ll"]["acc,none"]
    assert accuracy == pytest.approx(num_correct / len(MULTIPLE_CHOICE))


@pytest.mark.slow
def test_lm_eval_generate_until_matches_the_openai_client(
    lm_eval_results: dict[str, Any], server: RuntimeServer
) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    tok = AutoTokenizer.from_pretrained(TINY)
    samples = sorted(lm_eval_results["samples"]["kvpilot_gen"], key=lambda s: s["doc_id"])
    generated = [sample["resps"][0][0] for sample in samples]
    expected = []
    for row in GENERATE:
        ids = tok(row["question"], add_special_tokens=False).input_ids  # as lm-eval sends it
        answer = client.completions.create(
            model=MODEL, prompt=ids, max_tokens=MAX_GEN_TOKS, temperature=0, stop=["\n"]
        )
        expected.append(answer.choices[0].text)
    assert generated == expected
    assert any(text.strip() for text in generated)  # the comparison is not of empty strings
    matches = [text == row["answer"] for text, row in zip(generated, GENERATE, strict=True)]
    score = lm_eval_results["results"]["kvpilot_gen"]["exact_match,none"]
    assert score == pytest.approx(sum(matches) / len(matches))


@pytest.mark.slow
def test_guidellm_run_completes_without_errors(server: RuntimeServer, tmp_path: Path) -> None:
    report = tmp_path / "guidellm.json"
    prompt_tokens, output_tokens, num_requests = 32, 16, 12
    command = [
        str(Path(sys.executable).parent / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={server.url},model={MODEL}",
        "--profile", "kind=concurrent,streams=4",
        "--constraint", f"kind=max_requests,count={num_requests}",
        "--tokenizer", f"kind=hf_auto,model={TINY}",
        "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},"
                  f"output_tokens={output_tokens}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": num_requests, "errored": 0, "incomplete": 0,
                      "total": num_requests}  # fmt: skip
    counts = benchmark["metrics"]["output_token_count"]["successful"]
    assert counts["min"] == counts["max"] == output_tokens
    prompts = benchmark["metrics"]["prompt_token_count"]["successful"]
    assert prompts["min"] >= prompt_tokens
