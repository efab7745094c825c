"""Model URIs -> ModelSource: every scheme, and a clear error for each malformed form."""

from __future__ import annotations

import pytest

from kvpilot.contract.model_source import ModelSource, parse_model_uri


@pytest.mark.parametrize(
    ("uri", "scheme", "location", "path", "revision"),
    [
        ("hf://kvpilot/tiny-llama", "hf", "kvpilot/tiny-llama", "", None),
        (
            "hf://Qwen/Qwen2.5-7B-Instruct@a09a3545",
            "hf",
            "Qwen/Qwen2.5-7B-Instruct",
            "",
            "a09a3545",
        ),
        ("s3://models/tiny-llama", "s3", "models", "tiny-llama", None),
        ("s3://models/a/b/", "s3", "models", "a/b", None),
        ("pvc://weights/llama/8b", "pvc", "weights", "llama/8b", None),
        ("pvc://weights", "pvc", "weights", "", None),
        ("file:///srv/m%20x", "file", "/srv/m x", "", None),
        ("models/tiny-llama", "file", "models/tiny-llama", "", None),
    ],
)
def test_parse(uri: str, scheme: str, location: str, path: str, revision: str | None) -> None:
    assert parse_model_uri(uri) == ModelSource(uri, scheme, location, path, revision)


@pytest.mark.parametrize(
    ("uri", "is_fetched", "name"),
    [
        ("hf://kvpilot/tiny-llama@main", True, "tiny-llama"),
        ("s3://models/team/tiny-llama/", True, "tiny-llama"),
        ("pvc://weights/llama-8b", False, "llama-8b"),
        ("pvc://weights", False, "weights"),
        ("file:///srv/models/qwen", False, "qwen"),
    ],
)
def test_fetched_and_name(uri: str, is_fetched: bool, name: str) -> None:
    source = parse_model_uri(uri)
    assert (source.is_fetched, source.name) == (is_fetched, name)


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("gs://b/m", "unknown scheme gs://"),
        ("http://example.com/m", "unknown scheme http://"),
        ("hf://only-name", r"hf://ORG/NAME"),
        ("hf://a/b/c", r"hf://ORG/NAME"),
        ("s3://Bad_Bucket/m", "valid bucket name"),
        ("s3://models", "name the folder"),
        ("pvc://Not_A_Claim/x", "PersistentVolumeClaim name"),
        ("file://", "ABSOLUTE"),
    ],
)
def test_bad_uris_say_what_is_expected(uri: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        parse_model_uri(uri)
    assert uri in str(err.value)
