"""WebShop purchase reward: WebShop's ``get_reward`` shape without spaCy or fuzzy matching.

    reward = r_type * (n_attr_matched + n_option_matched + [price <= price_upper])
                    / (n_goal_attributes + n_goal_options + 1)

* r_type (WebShop ``get_type_reward``): 1.0, lowered to 0.5 when neither the product type
  ("query"), nor >= 2 breadcrumb levels, nor > 20 % of the wanted type words match; 0.1 when
  under 10 % of the type words are in the title; 0.0 when none are. WebShop takes the type
  words as spaCy nouns of the goal product's name; here they are ``Goal.type_words``.
* An attribute matches when the product lists it (case/space/hyphen-insensitive, or the same
  word set: a strict stand-in for WebShop's fuzzy ``token_set_ratio > 85``), or when it
  appears as whole words in the title, bullet points or description.
* A chosen option matches when it equals a goal option (normalised; WebShop is exact for
  size and fuzzy otherwise), or appears as whole words in the title/bullets/description, as
  in WebShop. Unlike WebShop, matches are
  capped at the number of goal options, so the reward stays in [0, 1].

Success is reward == 1 (SPEC §2).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ragen_core.envs.webshop.catalog import Goal, Product, tokens

__all__ = ["PurchaseScore", "score_purchase", "type_reward"]


@dataclass(frozen=True)
class PurchaseScore:
    reward: float
    r_type: float
    attributes_matched: int
    options_matched: int
    price_ok: bool


def _norm(text: str) -> str:
    return " ".join(tokens(text.replace("-", " ")))


def _in_text(phrase: str, text: str) -> bool:
    """``phrase`` occurs in ``text`` as whole words (normalised)."""
    p = _norm(phrase)
    return bool(p) and re.search(rf"(?<!\w){re.escape(p)}(?!\w)", _norm(text)) is not None


def type_reward(product: Product, goal: Goal) -> float:
    """WebShop's r_type with title-word overlap in place of spaCy nouns (module docstring)."""
    query_match = product.query.casefold() == goal.query.casefold()
    levels_p = {x.strip().casefold() for x in product.product_category.split("›")}
    levels_g = {x.strip().casefold() for x in goal.product_category.split("›")}
    category_match = len(levels_p & levels_g) >= 2
    desired = set(goal.type_words)
    title_score = len(desired & set(tokens(product.title))) / len(desired) if desired else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type


def score_purchase(product: Product, goal: Goal, chosen: Mapping[str, str],
                   price: float | None = None) -> PurchaseScore:
    """Reward for buying ``product`` with options ``chosen`` (name -> value) against ``goal``."""
    price = product.price if price is None else price
    text = " ".join([product.title, *product.bullet_points, product.description])
    listed = {_norm(a) for a in product.attributes}
    listed_sets = {frozenset(a.split()) for a in listed}
    n_attr = 0
    for attr in goal.attributes:
        a = _norm(attr)
        if a in listed or frozenset(a.split()) in listed_sets or _in_text(attr, text):
            n_attr += 1
    goal_opts = {_norm(o) for o in goal.options}
    n_opt = 0
    for value in chosen.values():
        v = _norm(value)
        if v in goal_opts or _in_text(value, text):
            n_opt += 1
    n_opt = min(n_opt, len(goal.options))
    price_ok = price <= goal.price_upper
    r_type = type_reward(product, goal)
    total = (n_attr + n_opt + int(price_ok)) / (len(goal.attributes) + len(goal.options) + 1)
    return PurchaseScore(reward=min(1.0, max(0.0, total * r_type)), r_type=r_type,
                         attributes_matched=n_attr, options_matched=n_opt, price_ok=price_ok)
