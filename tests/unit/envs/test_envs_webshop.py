"""WebShop offline: the generated catalogue, FTS5 search and its escaping, pages and actions,
hand-computed purchase rewards, goals achievable by an oracle, and the loader of the original
WebShop JSON files (fixtures/webshop: invented products written in that format).

Run: .venv/bin/python -m pytest tests/unit/envs/test_envs_webshop.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ragen_core.envs import make
from ragen_core.envs.webshop import (
    Goal,
    Product,
    fts_query,
    generate_catalog,
    load_webshop_json,
    score_purchase,
)
from ragen_core.envs.webshop.catalog import PRICE_STEPS, get_generated_catalog
from ragen_core.envs.webshop.env import WebShopEnv

FIXTURES = Path(__file__).parent / "fixtures" / "webshop"
FTS_ATTACKS = [
    '"red shoes', 'red" OR "', "shoes AND socks", "NOT shoes", "shoes NEAR socks", "NEAR(shoes socks, 2)",
    "sho*", "*", "^shoes", "title:shoes", "-shoes", "+shoes", "(shoes", "shoes)", "((()))", "{title}: x",
    "a OR", "AND", "OR NOT AND", "'; DROP TABLE docs; --", "docs MATCH 'x'", "\x00", "\ud800", "🙂 shoes",
    "ｓｈｏｅｓ", "é" * 500, "x" * 10_000, " ".join(["w"] * 5000), "\"\"\"\"", "\\", "%", "_",
]


@pytest.fixture(scope="module")
def catalog():
    return get_generated_catalog(0, 1200)


# ---------------------------------------------------------------- catalogue
def test_catalogue_size_categories_and_fields(catalog) -> None:
    assert len(catalog) >= 1000
    assert len({p.category for p in catalog.products}) >= 5
    assert len({p.asin for p in catalog.products}) == len(catalog)
    for p in catalog.products:
        assert p.title and p.description and p.attributes and p.price > 0
        assert p.query in p.title.lower()
        assert p.options and all(len(values) >= 2 for _, values in p.options)
        names = [n for n, _ in p.options]
        assert len(names) == len(set(names))
        values = [v for _, vs in p.options for v in vs]
        assert len(values) == len(set(values))  # click[value] is never ambiguous
    assert {n for p in catalog.products for n, _ in p.options} >= {"color", "size"}


def test_catalogue_is_a_function_of_its_seed() -> None:
    a, b, c = generate_catalog(3, 200), generate_catalog(3, 200), generate_catalog(4, 200)
    assert a.products == b.products
    assert a.products != c.products


# ---------------------------------------------------------------- search
def test_fts_query_quotes_every_word() -> None:
    assert fts_query('red "shoes" AND NEAR(x*)') == '"red" OR "shoes" OR "and" OR "near" OR "x"'
    assert fts_query("Shoes shoes SHOES") == '"shoes"'
    assert fts_query("*^():\"'") is None
    assert fts_query(" ".join(f"w{i}" for i in range(100))).count(" OR ") == 31  # capped at 32 terms


@pytest.mark.parametrize("query", FTS_ATTACKS)
def test_fts_syntax_in_queries_is_never_an_error(catalog, query: str) -> None:
    results = catalog.search(query)
    assert isinstance(results, list) and len(results) <= 50
    env = make("WebShop")
    env.reset(seed=0)
    obs, reward, terminated, _truncated, _info = env.step(f"search[{query}]")
    assert reward == 0.0 and not terminated
    assert env.render() == obs


def test_operators_are_searched_as_words(catalog) -> None:
    # "NOT" would exclude matches in FTS5 syntax; escaped, it is just another OR-ed word.
    assert set(catalog.search("hoodie")) <= set(catalog.search("NOT hoodie", limit=10_000))


def test_a_product_title_finds_that_product(catalog) -> None:
    rng = np.random.default_rng(0)
    for i in rng.choice(len(catalog), size=25, replace=False):
        p = catalog.products[int(i)]
        hits = catalog.search(p.title)
        assert p.asin in hits[:10]
        assert catalog.get(hits[0]).title == p.title  # the best hit has this exact title (maybe a twin)


# ---------------------------------------------------------------- reward (hand-computed)
def _hoodie(**kw) -> Product:
    base = {"asin": "B0TEST0001", "title": "Acme Classic Hoodie, Machine Wash", "category": "fashion",
                "query": "hoodie",
                "product_category": "Clothing › Fashion › Hoodie", "description": "Acme hoodie. Highlights: soft.",
                "bullet_points": ("Machine wash",), "attributes": ("machine wash", "fleece lined"),
                "options": (("color", ("black", "navy")), ("size", ("small", "large"))), "price": 30.0,
                "price_text": "$30.00"}
    return Product(**{**base, **kw})


GOAL = Goal(asin="B0TEST0001", instruction="i need a hoodie", attributes=("machine wash", "kangaroo pocket"),
            options=("navy", "large"), price_upper=40.0, query="hoodie",
            product_category="Clothing › Fashion › Hoodie", type_words=("hoodie",))


@pytest.mark.parametrize(("product", "chosen", "expected", "derivation"), [
    (_hoodie(), {"color": "navy", "size": "small"}, 0.6,
     "attrs 1/2 (no kangaroo pocket), options 1/2 (small != large), price 30 <= 40: (1+1+1)/(2+2+1)"),
    (_hoodie(), {"color": "navy", "size": "large"}, 0.8, "(1+2+1)/5"),
    (_hoodie(), {}, 0.4, "no options chosen: (1+0+1)/5"),
    (_hoodie(price=50.0), {"color": "navy", "size": "large"}, 0.6, "over the limit: (1+2+0)/5"),
    (_hoodie(attributes=("machine wash", "kangaroo pocket")), {"color": "navy", "size": "large"}, 1.0, "(2+2+1)/5"),
    (_hoodie(description="Has a kangaroo pocket."), {"color": "navy", "size": "large"}, 1.0,
     "attribute found as words in the description: (2+2+1)/5"),
    (_hoodie(title="Acme Socks", query="socks", product_category="Clothing › Fashion › Socks"),
     {"color": "navy", "size": "large"}, 0.0, "type word 'hoodie' not in the title: r_type 0"),
    (_hoodie(title="Acme Socks, Navy Hoodie Print", query="socks", product_category="Home › Decor › Socks"),
     {"color": "navy", "size": "large"}, 0.8, "title has 'hoodie': title_score 1 > 0.2, r_type 1; (1+2+1)/5"),
])
def test_purchase_reward(product: Product, chosen: dict, expected: float, derivation: str) -> None:
    assert score_purchase(product, GOAL, chosen).reward == pytest.approx(expected), derivation


def test_type_reward_levels() -> None:
    # 11 wanted type words, 1 in the title: title_score 1/11 = 0.09 < 0.1 -> r_type 0.1, and no
    # query/category match -> the 0.5 rule applies first but 0.1 overrides (WebShop's order).
    goal = Goal(asin="x", instruction="", attributes=(), options=(), price_upper=40.0, query="q",
                product_category="A › B", type_words=tuple("abcdefghijk"))
    product = _hoodie(title="a", query="other", product_category="C › D")
    assert score_purchase(product, goal, {}).reward == pytest.approx(0.1 * (0 + 0 + 1) / (0 + 0 + 1))
    # 1 of 4 words (0.25 > 0.2): r_type stays 1.0
    goal4 = Goal(**{**goal.__dict__, "type_words": ("a", "b", "c", "d")})
    assert score_purchase(product, goal4, {}).r_type == 1.0
    # 1 of 5 words (0.2, not > 0.2) and no query/category match: 0.5
    goal5 = Goal(**{**goal.__dict__, "type_words": ("a", "b", "c", "d", "e")})
    assert score_purchase(product, goal5, {}).r_type == 0.5


# ---------------------------------------------------------------- env pages
def _available(obs: str) -> list[str]:
    line = obs.splitlines()[-1]
    assert line.startswith("Available actions: ")
    return re.findall(r"(?:search|click)\[[^\]]*\]", line)


def _oracle(env: WebShopEnv) -> float:
    """Buy the goal's own product with the goal's options; return the reward."""
    goal = env.goal
    target = env.catalog.get(goal.asin)
    env.step(f"search[{target.title}]")
    assert f"click[{goal.asin.lower()}]" in env.action_names
    env.step(f"click[{goal.asin}]")
    for value in goal.options:
        env.step(f"click[{value}]")
    _, reward, terminated, _, _info = env.step("click[buy now]")
    assert terminated
    return reward


def test_goal_is_achievable_for_many_seeds() -> None:
    env = make("WebShop")
    for seed in range(30):
        env.reset(seed=seed)
        assert _oracle(env) == 1.0


def test_pages_navigation_and_listed_actions() -> None:
    env = make("WebShop", max_steps=None)
    obs, _ = env.reset(seed=1)
    assert obs.startswith("Instruction: ") and _available(obs) == ["search[<query>]"] == env.action_names
    obs, _, _, _, info = env.step("search[black]")
    assert info["page"] == "results" and _available(obs) == env.action_names
    assert "click[next >]" in env.action_names and "click[< prev]" not in env.action_names
    page1 = obs
    obs2, *_ = env.step("click[next >]")
    assert "page 2 of" in obs2 and "click[< prev]" in env.action_names
    obs, *_ = env.step("click[< prev]")
    assert obs == page1
    item = env.action_names[-1]
    obs, _, _, _, info = env.step(item.upper())  # case-insensitive
    assert info["page"] == "item" and "click[buy now]" in env.action_names
    assert "Selected: none" in obs
    option = next(a for a in env.action_names if a not in ("click[back to search]", "click[< prev]", "click[buy now]"))
    obs, _, _, _, info = env.step(option)
    assert info["action_is_effective"] and f": {option[6:-1]}" in obs.split("Selected: ")[1]
    _, _, _, _, info = env.step(option)
    assert not info["action_is_effective"] and not info["invalid_action"]  # same choice again: no change
    obs, *_ = env.step("click[< prev]")
    assert obs == page1
    obs, _, _, _, info = env.step("click[back to search]")
    assert info["page"] == "search"


@pytest.mark.parametrize("bad", ["click[b0zzzzzzzz]", "click[buy now]", "search[]", "search[ *** ]", "buy now",
                                 "search[" + "word " * 200 + "]", "click[next >]"])
def test_invalid_actions_on_the_search_page(bad: str) -> None:
    env = make("WebShop")
    obs, _ = env.reset(seed=2)
    obs2, reward, terminated, _, info = env.step(bad)
    assert obs2 == obs and reward == 0.0 and not terminated and info["invalid_action"]


def test_search_only_from_the_search_page() -> None:
    env = make("WebShop")
    env.reset(seed=2)
    obs, *_ = env.step("search[tea]")
    obs2, _, _, _, info = env.step("search[coffee]")
    assert obs2 == obs and info["invalid_action"]


def test_wrong_purchase_scores_below_one() -> None:
    env = make("WebShop")
    env.reset(seed=5)
    env.step(f"search[{env.goal.query}]")
    other = next(a for a in env.action_names if a.startswith("click[b0") and a != f"click[{env.goal.asin.lower()}]")
    env.step(other)
    _, reward, terminated, _, info = env.step("click[buy now]")  # no options chosen: cannot be 1
    assert terminated and 0.0 <= reward < 1.0 and not info["success"]


# ---------------------------------------------------------------- original JSON loader
def test_loader_reads_the_original_format() -> None:
    cat = load_webshop_json(FIXTURES / "items_shuffle_mini.json", FIXTURES / "items_ins_v2_mini.json",
                            FIXTURES / "items_human_ins_mini.json", seed=0)
    # nan, dup skipped
    assert [p.asin for p in cat.products] == ["B0FIX00001", "B0FIX00002", "B0FIX00003", "B0FIX00004"]
    boots = cat.get("b0fix00001")
    assert boots.options == (("color", ("brown", "black | grey")), ("size", ("9", "10", "11 wide")))
    assert boots.price == 59.99 and boots.price_text == "$59.99"
    assert boots.attributes == ("waterproof", "lace up", "rubber sole")
    assert boots.bullet_points == ("Waterproof membrane", "Lace up closure", "Rubber sole")
    tea = cat.get("B0FIX00002")
    assert 8.49 <= tea.price <= 15.99 and tea.price_text == "$8.49 to $15.99"  # paid at a draw inside the range
    assert tea.bullet_points == ("Caffeine free herbal blend",)
    serum = cat.get("B0FIX00003")
    assert serum.price == 100.0 and serum.options == ()  # WebShop's default price when none is listed
    # human goals: 2 kept (one has no attributes, one names a product that is not loaded)
    assert [g.asin for g in cat.goals] == ["B0FIX00001", "B0FIX00004"]
    g = cat.goals[0]
    assert g.attributes == ("waterproof", "rubber sole") and g.options == ("brown", "10")
    # price limit: the larger of two of the next four 10-dollar steps above 59.99 (60, 70, 80, 90)
    assert g.price_upper in (70.0, 80.0, 90.0) and g.price_upper in PRICE_STEPS
    assert g.instruction.endswith(f", and price lower than {g.price_upper:.2f} dollars")
    assert "hiking" in g.type_words and "boots" in g.type_words


def test_loader_synthetic_goals_without_the_human_file() -> None:
    cat = load_webshop_json(FIXTURES / "items_shuffle_mini.json", FIXTURES / "items_ins_v2_mini.json", seed=1)
    assert [g.asin for g in cat.goals] == ["B0FIX00001", "B0FIX00002", "B0FIX00004"]  # serum has no instruction
    tea = cat.goals[1]
    assert tea.instruction.startswith("i want caffeine free organic green tea with flavor name: ")
    assert len(tea.options) == 2 and tea.attributes == ("caffeine free",)


def test_env_on_the_original_files() -> None:
    env = make("WebShop", products_path=FIXTURES / "items_shuffle_mini.json",
               attributes_path=FIXTURES / "items_ins_v2_mini.json",
               human_goals_path=FIXTURES / "items_human_ins_mini.json")
    seen = set()
    for seed in range(12):
        env.reset(seed=seed)
        seen.add(env.goal.asin)
        assert _oracle(env) == 1.0
    assert seen == {"B0FIX00001", "B0FIX00004"}


def test_paths_need_a_products_file() -> None:
    with pytest.raises(ValueError):
        make("WebShop", human_goals_path=FIXTURES / "items_human_ins_mini.json")


def test_goal_split_and_default_size() -> None:
    paths = {"products_path": FIXTURES / "items_shuffle_mini.json",
             "attributes_path": FIXTURES / "items_ins_v2_mini.json",
             "human_goals_path": FIXTURES / "items_human_ins_mini.json"}
    env = make("WebShop", goal_split=(1, 2), **paths)
    assert {(env.reset(seed=s), env.goal.asin)[1] for s in range(8)} == {"B0FIX00004"}  # goals[1:2] only
    assert len(env.catalog) == 4  # a JSON catalogue is not cut to the generated default size
    with pytest.raises(ValueError):
        make("WebShop", goal_split=(0, 10)).reset(seed=0)  # generated catalogue: no fixed goals
    with pytest.raises(ValueError):
        make("WebShop", goal_split=(5, 9), **paths).reset(seed=0)  # empty slice
    assert len(make("WebShop").catalog) == 1200
