"""The README's gateway example is read by the gateway's own config parsers (the same calls the
CLI makes at start), so the copy-paste example cannot drift from what the gateway accepts."""

from __future__ import annotations

import re
from pathlib import Path

from kvpilot.gateway.budget.config import key_book
from kvpilot.gateway.budget.setup import read_settings
from kvpilot.gateway.cache.config import settings_from
from kvpilot.gateway.config import load_cache_spec, load_routes
from kvpilot.gateway.routing.cascade_rules import CascadeRule

README = Path(__file__).resolve().parents[2] / "README.md"
HEREDOC = re.compile(r"^cat > gateway\.yaml <<'YAML'\n(.*?)^YAML$", re.DOTALL | re.MULTILINE)


def test_the_readme_gateway_example_covers_keys_budgets_cache_and_cascade(
    tmp_path: Path,
) -> None:
    blocks = HEREDOC.findall(README.read_text())
    assert len(blocks) == 1, "the README has one gateway.yaml example"
    config = tmp_path / "gateway.yaml"
    config.write_text(blocks[0])

    routes = {route.model: route for route in load_routes(config, env={})}
    assert routes["big"].cascade == (CascadeRule("small", 512, True),)
    budgets = read_settings(config)
    book = key_book(budgets.document.keys, budgets.document.teams)
    (key,) = book.values()
    assert key.team == "research" and key.models == frozenset({"big", "small"})
    units = sorted((limit.scope.split(":")[0], limit.unit) for limit in key.limits)
    assert units == [("key", "requests"), ("key", "total_tokens"), ("team", "cost")]
    assert set(budgets.prices) == set(routes)  # the team's cost limit needs every model priced
    cache = settings_from(load_cache_spec(config), None, budgets.redis_url)
    assert cache.enabled and cache.store == "redis" and cache.redis_url == budgets.redis_url
