"""Where an adapter is read from without fetching it: the cache entry of its URI (named as the
operator's model cache names a claim) and a pvc:// adapter's path under the claims directory."""

from __future__ import annotations

import pytest

from kvpilot.contract.adapter_cache import AdapterDirs, claim_path, entry_name, parse_claims
from kvpilot.contract.model_source import parse_model_uri
from kvpilot.operator.reconcile import manifests


def test_an_adapter_is_keyed_as_the_model_cache_keys_a_model() -> None:
    uri = "hf://org/adapter@v2"
    assert manifests.cache_claim_name(uri) == f"kvpilot-model-cache-{entry_name(uri)}"
    assert entry_name(uri) != entry_name("hf://org/adapter")  # another revision, another entry
    assert AdapterDirs(cache_dir="/c").cache_entry(uri) == f"/c/{entry_name(uri)}"
    assert AdapterDirs().cache_entry(uri) is None


@pytest.mark.parametrize(
    ("uri", "path"),
    [
        ("pvc://loras/tenant-a", "/mnt/loras/tenant-a"),
        ("pvc://loras/a/b/", "/mnt/loras/a/b"),
        ("pvc://loras", "/mnt/loras"),  # the claim holds one adapter at its top
        ("pvc://more/x", "/mnt/more/x"),
    ],
)
def test_a_pvc_adapter_is_read_under_its_claims_mount(uri: str, path: str) -> None:
    claims = parse_claims(["loras=/mnt/loras", "more=/mnt/more"])
    assert claim_path(claims, parse_model_uri(uri)) == path


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("pvc://loras/../other/x", "may not contain '..'"),
        ("hf://org/adapter", "not a pvc:// URI"),
        ("pvc://other/x", "claim 'other' is not mounted in this pod \\(mounted: loras\\)"),
    ],
)
def test_a_path_outside_the_mounted_claims_is_refused(uri: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        claim_path({"loras": "/mnt/loras"}, parse_model_uri(uri))


@pytest.mark.parametrize("item", ["loras", "=/mnt/x", "loras="])
def test_a_malformed_claim_mount_is_refused(item: str) -> None:
    with pytest.raises(ValueError, match="expected CLAIM=DIR"):
        parse_claims([item])
