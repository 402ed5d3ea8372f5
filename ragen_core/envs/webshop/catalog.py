"""WebShop catalogue: product and goal records, a seeded generator, and SQLite FTS5 search.

The original WebShop needs a Java search engine (pyserini/Lucene) and a scraped catalogue
that cannot be downloaded here (SPEC §2). This module builds an equivalent offline:

* ``generate_catalog(seed, n_products)``: products with titles, descriptions, feature
  bullets, attributes, options (size/colour/flavour/...) and prices in six departments
  (webshop/vocab.py). 1,200 products build in well under a second.
* ``make_goal(catalog, rng)``: a shopping instruction in WebShop's synthetic-goal shape
  ("i am looking for ... that is A and B, with color: x, and size: y, and price lower than
  P dollars"), written for a randomly chosen product so it is always achievable.
* ``Catalog.search``: SQLite FTS5 with BM25 ranking (title weighted above attributes, above
  the body). User text is never passed as FTS5 syntax: it is reduced to word tokens, each
  quoted as a literal phrase and OR-ed (``fts_query``), so quotes, AND/OR/NOT/NEAR, ``*``,
  ``^``, ``:`` and parentheses are searched for as words or dropped, never an error.

``load_webshop_json`` (webshop/loader.py) reads the original product/goal files into the
same records. Catalogues are cached per process (``get_generated_catalog``).
"""

from __future__ import annotations

import functools
import os
import re
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ragen_core.envs.webshop.vocab import BRANDS, DEPARTMENTS, FILLERS, USES

__all__ = [
    "PRICE_STEPS",
    "Catalog",
    "Goal",
    "Product",
    "fts_query",
    "generate_catalog",
    "get_generated_catalog",
    "make_goal",
    "price_upper_for",
    "tokens",
]

_WORD = re.compile(r"\w+")
MAX_QUERY_TERMS = 32
# WebShop's PRICE_RANGE: candidate price limits 10, 20, ..., 990 dollars.
PRICE_STEPS: tuple[float, ...] = tuple(10.0 * i for i in range(1, 100))
NO_PRICE_LIMIT = 1_000_000.0


@dataclass(frozen=True)
class Product:
    """One catalogue item (field names follow WebShop's product dicts where they exist)."""

    asin: str
    title: str
    category: str
    """Top-level department (WebShop ``category``)."""
    query: str
    """Product type (WebShop ``query``)."""
    product_category: str
    """Breadcrumb, levels separated by '›' (WebShop ``product_category``)."""
    description: str
    bullet_points: tuple[str, ...]
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    """(option name, values) in display order."""
    price: float
    """The price paid at purchase."""
    price_text: str

    def option_dict(self) -> dict[str, tuple[str, ...]]:
        return dict(self.options)


@dataclass(frozen=True)
class Goal:
    """A shopping task (WebShop goal dict: instruction_text, attributes, goal_options, price_upper)."""

    asin: str
    """The product the instruction was written for (one product that scores 1)."""
    instruction: str
    attributes: tuple[str, ...]
    options: tuple[str, ...]
    """Wanted option values (WebShop ``goal_options``)."""
    price_upper: float
    query: str
    product_category: str
    type_words: tuple[str, ...]
    """Words naming the wanted kind of product, for the type reward (stand-in for spaCy nouns)."""


def tokens(text: str) -> list[str]:
    """Lower-case word tokens (Unicode-aware)."""
    return _WORD.findall(text.casefold())


def fts_query(text: str, max_terms: int = MAX_QUERY_TERMS) -> str | None:
    """A safe FTS5 MATCH expression for free user text, or None when it has no words.

    Each distinct word becomes a double-quoted FTS5 string (a literal phrase, so AND, NEAR,
    ``*`` etc. inside it mean nothing) and the phrases are OR-ed, like WebShop's Lucene
    default. ``\\w+`` tokens hold no double quote; the ``replace`` is belt and braces.
    """
    terms: list[str] = []
    for t in tokens(text):
        if t not in terms:
            terms.append(t)
            if len(terms) == max_terms:
                break
    if not terms:
        return None
    return " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)


class Catalog:
    """Products, optional fixed goals, and an in-memory FTS5 index over the products."""

    def __init__(self, products: Sequence[Product], goals: Sequence[Goal] = (), name: str = "catalog") -> None:
        if not products:
            raise ValueError("a catalogue needs at least one product")
        self.name = name
        self.products: tuple[Product, ...] = tuple(products)
        self.goals: tuple[Goal, ...] = tuple(goals)
        self._by_asin = {p.asin.upper(): p for p in self.products}
        if len(self._by_asin) != len(self.products):
            raise ValueError("duplicate asin in catalogue")
        self._lock = threading.Lock()
        # check_same_thread=False + a lock: rollouts may step envs from worker threads.
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._db.execute(
            "CREATE VIRTUAL TABLE docs USING fts5(asin UNINDEXED, title, attributes, body, "
            "tokenize='unicode61 remove_diacritics 2')"
        )
        self._db.executemany(
            "INSERT INTO docs(rowid, asin, title, attributes, body) VALUES (?, ?, ?, ?, ?)",
            [
                (i, p.asin, p.title, " ; ".join(p.attributes),
                 " ".join([p.description, *p.bullet_points, p.product_category, p.query,
                           *(v for _, vs in p.options for v in vs)]))
                for i, p in enumerate(self.products)
            ],
        )
        self._db.commit()

    def __len__(self) -> int:
        return len(self.products)

    def get(self, asin: str) -> Product | None:
        return self._by_asin.get(asin.upper())

    def search(self, text: str, limit: int = 50) -> list[str]:
        """ASINs of the best BM25 matches for free text (ties broken by catalogue order)."""
        match = fts_query(text)
        if match is None:
            return []
        with self._lock:
            rows = self._db.execute(
                # bm25 weights per column: asin (unindexed), title, attributes, body.
                "SELECT asin FROM docs WHERE docs MATCH ? ORDER BY bm25(docs, 0.0, 10.0, 5.0, 1.0), rowid "
                "LIMIT ?",
                (match, int(limit)),
            ).fetchall()
        return [r[0] for r in rows]


def _asin(rng: np.random.Generator, taken: set[str]) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    while True:
        asin = "B0" + "".join(alphabet[int(i)] for i in rng.integers(len(alphabet), size=8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _pick(rng: np.random.Generator, pool: Sequence[str], k: int) -> tuple[str, ...]:
    """k distinct items of pool, kept in pool order (stable, readable option lists)."""
    idx = sorted(int(i) for i in rng.choice(len(pool), size=min(k, len(pool)), replace=False))
    return tuple(pool[i] for i in idx)


def generate_catalog(seed: int = 0, n_products: int = 1200) -> Catalog:
    """A seeded catalogue of ``n_products`` spread evenly over the six departments."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(7,)))
    taken: set[str] = set()
    products = []
    for i in range(n_products):
        dept = DEPARTMENTS[i % len(DEPARTMENTS)]
        ptype, pool = dept.types[int(rng.integers(len(dept.types)))]
        brand = BRANDS[int(rng.integers(len(BRANDS)))]
        style = dept.styles[int(rng.integers(len(dept.styles)))]
        attrs = _pick(rng, pool, int(rng.integers(3, min(5, len(pool)) + 1)))
        shown = [attrs[int(j)] for j in rng.permutation(len(attrs))[:2]]
        title = f"{brand} {style} {ptype.title()}, " + ", ".join(a.title() for a in shown)
        options = []
        for k, (opt_name, values) in enumerate(dept.options):
            if k > 0 and rng.random() < 0.15:  # some products offer only one option dimension
                continue
            options.append((opt_name, _pick(rng, values, int(rng.integers(2, 6)))))
        lo, hi = dept.price
        price = round(float(np.floor(rng.uniform(lo, hi))) + 0.99, 2)
        use = USES[int(rng.integers(len(USES)))]
        filler = FILLERS[int(rng.integers(len(FILLERS)))]
        description = f"{brand} {ptype} made for {use}. Highlights: {', '.join(attrs)}. {filler}"
        products.append(Product(
            asin=_asin(rng, taken), title=title, category=dept.name, query=ptype,
            product_category=f"{dept.breadcrumb} › {ptype.title()}", description=description,
            bullet_points=tuple(a.capitalize() for a in attrs), attributes=attrs,
            options=tuple(options), price=price, price_text=f"${price:.2f}",
        ))
    return Catalog(products, name=f"generated(seed={seed}, n={n_products})")


def price_upper_for(price: float, rng: np.random.Generator) -> float:
    """WebShop's goal price limit: the larger of two draws among the next four 10-dollar steps
    above the price; no limit when fewer than two steps remain."""
    steps = [p for p in PRICE_STEPS if p > price][:4]
    if len(steps) < 2:
        return NO_PRICE_LIMIT
    i, j = rng.choice(len(steps), size=2, replace=False)
    return max(steps[int(i)], steps[int(j)])


_OPENERS = ("i am looking for", "i need", "i want to buy", "find me", "i would like")


def make_goal(catalog: Catalog, rng: np.random.Generator, split: tuple[int, int] | None = None) -> Goal:
    """A fixed goal of the catalogue (from ``goals[start:stop]`` when ``split`` is given) if it has
    any, else a new instruction for a random product."""
    if catalog.goals:
        pool = catalog.goals[split[0]:split[1]] if split else catalog.goals
        if not pool:
            raise ValueError(f"goal split {split} is empty: the catalogue has {len(catalog.goals)} goals")
        return pool[int(rng.integers(len(pool)))]
    if split is not None:
        raise ValueError("goal_split needs a catalogue with fixed goals (the original WebShop files)")
    p = catalog.products[int(rng.integers(len(catalog.products)))]
    k = int(rng.integers(1, min(3, len(p.attributes)) + 1)) if p.attributes else 0
    attrs = _pick(rng, p.attributes, k) if k else ()
    chosen = [(name, values[int(rng.integers(len(values)))]) for name, values in p.options if values]
    upper = price_upper_for(p.price, rng)
    article = "" if p.query.endswith("s") else ("an " if p.query[:1] in "aeiou" else "a ")
    text = f"{_OPENERS[int(rng.integers(len(_OPENERS)))]} {article}{p.query}"
    if attrs:
        text += " that is " + " and ".join(attrs)
    if chosen:
        text += " with " + ", and ".join(f"{n}: {v}" for n, v in chosen)
    if upper < NO_PRICE_LIMIT:
        text += f", and price lower than {upper:.2f} dollars"
    return Goal(
        asin=p.asin, instruction=text, attributes=attrs, options=tuple(v for _, v in chosen),
        price_upper=upper, query=p.query, product_category=p.product_category,
        type_words=tuple(tokens(p.query)),
    )


@functools.lru_cache(maxsize=8)
def _cached_catalog(seed: int, n_products: int, pid: int) -> Catalog:
    return generate_catalog(seed, n_products)


def get_generated_catalog(seed: int = 0, n_products: int = 1200) -> Catalog:
    """The generated catalogue, built once per process (the pid in the key keeps a forked
    child from sharing its parent's SQLite connection)."""
    return _cached_catalog(int(seed), int(n_products), os.getpid())
