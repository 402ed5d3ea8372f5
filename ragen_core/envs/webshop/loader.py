"""Read the original WebShop data files into a Catalog (for users who have them; SPEC §2).

Files (names as in WebShop's ``data/`` folder):

* products, e.g. ``items_shuffle_1000.json``: a list of product dicts with ``asin``,
  ``name``, ``full_description``, ``small_description`` (list or str), ``pricing`` ("$12.99"
  or "$10.99 - $20.99"), ``customization_options`` ({"Color": [{"value": ...}, ...]}),
  ``category``, ``query``, ``product_category``;
* attributes, e.g. ``items_ins_v2_1000.json``: {asin: {"attributes": [...], "instruction":
  ..., "instruction_attributes": [...]}} (product attributes; synthetic goals);
* human goals, ``items_human_ins.json``: {asin: [{"instruction": ..., "instruction_attributes":
  [...], "instruction_options": [...]}, ...]}.

As in WebShop's ``load_products``: option values are lower-cased with "/" read as " | ",
a price range is paid at a uniform draw inside it (seeded here), and goals get a price limit
from ``price_upper_for``. Goals come from the human file when given, else from the synthetic
instructions of the attributes file (one per product, options drawn with the seed); with
neither, episodes synthesise goals from product attributes (``make_goal``).

    from ragen_core.envs import make
    env = make("WebShop", products_path="data/items_shuffle_1000.json",
               attributes_path="data/items_ins_v2_1000.json", human_goals_path="data/items_human_ins.json")
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from ragen_core.envs.webshop.catalog import NO_PRICE_LIMIT, Catalog, Goal, Product, price_upper_for, tokens

__all__ = ["load_webshop_json"]

_STOPWORDS = frozenset(["a", "an", "and", "the", "for", "with", "of", "to", "in", "on", "by", "x", "pack", "count",
                        "oz", "inch", "set"])


def _read(path: str | os.PathLike[str]) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _prices(pricing: Any) -> list[float]:
    """WebShop's parse: every '$'-separated piece with non-digits stripped."""
    if isinstance(pricing, (int, float)):
        return [float(pricing)]
    if isinstance(pricing, list):
        return [float(p) for p in pricing if isinstance(p, (int, float))][:2]
    out = []
    for piece in str(pricing or "").split("$")[1:]:
        digits = re.sub(r"[^\d.]", "", piece)
        try:
            out.append(float(digits))
        except ValueError:
            continue
    return out[:2]


def _product(raw: dict[str, Any], attrs: dict[str, Any], rng: np.random.Generator) -> Product:
    asin = str(raw["asin"]).upper()
    prices = _prices(raw.get("pricing")) or [100.0]
    price = prices[0] if len(prices) == 1 else float(rng.uniform(prices[0], prices[1]))
    price_text = f"${prices[0]:.2f}" if len(prices) == 1 else f"${prices[0]:.2f} to ${prices[1]:.2f}"
    options = []
    for opt_name, contents in (raw.get("customization_options") or {}).items():
        if not contents:
            continue
        values = [str(c.get("value", "")).strip().replace("/", " | ").lower() for c in contents]
        values = [v for i, v in enumerate(values) if v and v not in values[:i]]
        if values:
            options.append((str(opt_name).lower(), tuple(values)))
    small = raw.get("small_description") or []
    bullets = tuple(str(b) for b in (small if isinstance(small, list) else [small]))
    return Product(
        asin=asin, title=str(raw.get("name") or raw.get("Title") or asin), category=str(raw.get("category", "")),
        query=str(raw.get("query", "")).lower().strip(), product_category=str(raw.get("product_category", "")),
        description=str(raw.get("full_description") or ""), bullet_points=bullets,
        attributes=tuple(str(a) for a in attrs.get(asin, {}).get("attributes", [])),
        options=tuple(options), price=round(price, 2), price_text=price_text,
    )


def _type_words(name: str) -> tuple[str, ...]:
    # Stand-in for WebShop's spaCy nouns of the product name: its content words.
    return tuple(dict.fromkeys(t for t in tokens(name) if t not in _STOPWORDS and not t.isdigit()))


def _goal(p: Product, text: str, attributes: list[str], options: list[str], rng: np.random.Generator) -> Goal:
    upper = price_upper_for(p.price, rng)
    price_text = f", and price lower than {upper:.2f} dollars" if upper < NO_PRICE_LIMIT else ""
    return Goal(asin=p.asin, instruction=text.strip().strip(".") + price_text, attributes=tuple(attributes),
                options=tuple(options), price_upper=upper, query=p.query, product_category=p.product_category,
                type_words=_type_words(p.title))


def load_webshop_json(
    products_path: str | os.PathLike[str],
    attributes_path: str | os.PathLike[str] | None = None,
    human_goals_path: str | os.PathLike[str] | None = None,
    *,
    num_products: int | None = None,
    seed: int = 0,
) -> Catalog:
    """A Catalog from WebShop's JSON files (module docstring); ``num_products`` keeps the first n."""
    rng = np.random.default_rng(seed)
    raw_products = _read(products_path)
    if not isinstance(raw_products, list):
        raise ValueError(f"{products_path}: expected a JSON list of products")  # bad file content: a ValueError
    attrs = {str(k).upper(): v for k, v in (_read(attributes_path) if attributes_path else {}).items()}
    products: list[Product] = []
    seen: set[str] = set()
    for raw in raw_products[:num_products] if num_products else raw_products:
        asin = str(raw.get("asin", ""))
        if asin in ("", "nan") or len(asin) > 10 or asin.upper() in seen:  # WebShop's filter
            continue
        seen.add(asin.upper())
        products.append(_product(raw, attrs, rng))
    by_asin = {p.asin: p for p in products}
    goals: list[Goal] = []
    if human_goals_path:
        for asin, items in _read(human_goals_path).items():
            p = by_asin.get(str(asin).upper())
            if p is None:
                continue
            for item in items:
                if item.get("instruction_attributes"):  # WebShop skips goals without attributes
                    goals.append(_goal(p, item["instruction"], item["instruction_attributes"],
                                       item.get("instruction_options", []), rng))
    else:
        for p in products:
            a = attrs.get(p.asin, {})
            if a.get("instruction") and a.get("instruction_attributes"):
                chosen = [(n, vs[int(rng.integers(len(vs)))]) for n, vs in p.options]
                opt_text = " with " + ", and ".join(f"{n}: {v}" for n, v in chosen) if chosen else ""
                goals.append(_goal(p, a["instruction"].strip().strip(".") + opt_text,
                                   a["instruction_attributes"], [v for _, v in chosen], rng))
    return Catalog(products, goals, name=f"webshop-json({os.path.basename(os.fspath(products_path))})")
