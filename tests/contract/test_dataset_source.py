"""Eval dataset URIs: every form names one file; bad ones say what is wrong and what is expected."""

from __future__ import annotations

import pytest

from kvpilot.contract.dataset_source import DatasetSource, parse_dataset_uri


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        (
            "hf://kvpilot/tiny-llama/eval.txt",
            DatasetSource(
                "hf://kvpilot/tiny-llama/eval.txt", "hf", "kvpilot/tiny-llama", "eval.txt"
            ),
        ),
        (
            "hf://datasets/org/set@v1.0/data/test.jsonl",
            DatasetSource(
                "hf://datasets/org/set@v1.0/data/test.jsonl",
                "hf",
                "org/set",
                "data/test.jsonl",
                revision="v1.0",
                repo_type="dataset",
            ),
        ),
        (
            "s3://models/tiny-llama/eval.txt",
            DatasetSource("s3://models/tiny-llama/eval.txt", "s3", "models", "tiny-llama/eval.txt"),
        ),
        (
            "pvc://eval-sets/team/eval.jsonl",
            DatasetSource("pvc://eval-sets/team/eval.jsonl", "pvc", "eval-sets", "team/eval.jsonl"),
        ),
        ("file:///data/eval.txt", DatasetSource("file:///data/eval.txt", "file", "/data/eval.txt")),
        (
            "models/tiny-llama/eval.txt",
            DatasetSource("models/tiny-llama/eval.txt", "file", "models/tiny-llama/eval.txt"),
        ),
    ],
)
def test_each_form_names_one_file(uri: str, expected: DatasetSource) -> None:
    assert parse_dataset_uri(uri) == expected


def test_the_file_name_keeps_its_suffix_which_selects_the_format() -> None:
    assert parse_dataset_uri("hf://datasets/org/set/data/test.jsonl").file_name == "test.jsonl"
    assert parse_dataset_uri("s3://bucket/eval.txt").file_name == "eval.txt"
    assert parse_dataset_uri("s3://bucket/eval.txt").is_fetched
    assert not parse_dataset_uri("pvc://claim/eval.txt").is_fetched


@pytest.mark.parametrize(
    ("uri", "cause"),
    [
        ("hf://kvpilot/tiny-llama", "name the file in the repo or bucket"),
        ("s3://models", "name the file in the repo or bucket"),
        ("s3://models/prefix/", "name the file in the repo or bucket"),
        ("pvc://claim", "expected pvc://CLAIM/PATH naming the file"),
        ("gs://bucket/eval.txt", "unknown scheme gs://"),
        ("hf://not a repo/x/eval.txt", "expected hf://ORG/NAME"),
        ("s3://Bad_Bucket/eval.txt", "valid bucket name"),
        ("pvc://Bad_Claim/eval.txt", "valid PersistentVolumeClaim name"),
    ],
)
def test_a_bad_uri_says_why_and_names_itself(uri: str, cause: str) -> None:
    with pytest.raises(ValueError, match="dataset URI") as raised:
        parse_dataset_uri(uri)
    assert cause in str(raised.value) and repr(uri) in str(raised.value)
