"""WebShop that works offline (SPEC §2): search and buy from a seeded catalogue.

Pages and actions, as in WebShop (Yao et al. 2022):

* search page: ``search[<query>]`` (SQLite FTS5, BM25; top 50 results);
* results page: 10 per page; ``click[<item id>]``, ``click[next >]``, ``click[< prev]``,
  ``click[back to search]``;
* item page: title, price, category, description, features, options;
  ``click[<option value>]`` selects it, ``click[buy now]``, ``click[< prev]`` (back to the
  results), ``click[back to search]``;
* buying ends the episode with the reward of webshop/reward.py in [0, 1]; success when it is 1.

Every observation starts with the instruction and ends with the list of available actions.
Actions are free text (``free_form_actions``): ``search``/``click`` are case-insensitive,
click targets are matched case-insensitively against the page's clickables, anything else
(unknown target, search off the search page, a query with no words, a query over
``max_query_chars``) is an invalid action with no state change. The episode's goal comes from
the seed; the catalogue from ``catalog_seed`` and ``num_products`` (default 1,200), or from
the original WebShop JSON files when ``products_path`` is given (all products unless
``num_products`` says otherwise; see webshop/loader.py). With fixed goals (the JSON files),
``goal_split=(start, stop)`` draws goals only from ``goals[start:stop]``, e.g. WebShop's test
split ``(0, 500)``.

    from ragen_core.envs import make
    env = make("WebShop"); obs, _ = env.reset(seed=0); print(obs)
    obs, *_ = env.step("search[running shoes lightweight]")
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from ragen_core.envs.base import StepOutcome, TextEnv, checked_params
from ragen_core.envs.webshop.catalog import Catalog, Goal, get_generated_catalog, make_goal, tokens
from ragen_core.envs.webshop.loader import load_webshop_json
from ragen_core.envs.webshop.reward import PurchaseScore, score_purchase

__all__ = ["WebShopEnv"]

BACK, NEXT, PREV, BUY = "back to search", "next >", "< prev", "buy now"
DEFAULT_PRODUCTS = 1200
"""Size of the generated catalogue unless ``num_products`` says otherwise (SPEC: >= 1,000)."""
MAX_PRODUCTS = 1_200_000
"""Most products: the original WebShop's 1.18 M (a generated catalogue builds ~14,000 a second)."""
_ACTION = re.compile(r"(search|click)\s*\[(.*)\]", re.IGNORECASE | re.DOTALL)


@functools.lru_cache(maxsize=4)
def _cached_json_catalog(products: str, attributes: str | None, human_goals: str | None,
                         num_products: int | None, seed: int, pid: int) -> Catalog:
    return load_webshop_json(products, attributes, human_goals, num_products=num_products, seed=seed)


class WebShopEnv(TextEnv):
    """Search, open an item, pick options, buy (SPEC §2 table, row WebShop)."""

    name = "WebShop"
    free_form_actions = True

    @checked_params
    def __init__(
        self,
        *,
        num_products: Annotated[int, Field(ge=1, le=MAX_PRODUCTS)] | None = None,
        catalog_seed: Annotated[int, Field(ge=0)] = 0,
        products_path: str | os.PathLike[str] | None = None,
        attributes_path: str | os.PathLike[str] | None = None,
        human_goals_path: str | os.PathLike[str] | None = None,
        max_steps: Annotated[int, Field(ge=1)] | None = 9,
        results_per_page: Annotated[int, Field(ge=1, le=100)] = 10,
        max_results: Annotated[int, Field(ge=1, le=1000)] = 50,
        max_query_chars: Annotated[int, Field(ge=1, le=10_000)] = 500,
        goal_split: Annotated[tuple[Annotated[int, Field(ge=0)], int], Field(strict=False)] | None = None,
    ) -> None:
        super().__init__(max_steps=max_steps)
        self.num_products, self.catalog_seed = num_products, catalog_seed
        self.paths = tuple(None if p is None else os.fspath(p)
                           for p in (products_path, attributes_path, human_goals_path))
        if self.paths[0] is None and any(self.paths[1:]):
            raise ValueError("attributes_path / human_goals_path need products_path")
        for key, path in zip(("products_path", "attributes_path", "human_goals_path"), self.paths, strict=True):
            if path is not None and not os.path.isfile(path):  # now, not at the first reset of a run
                raise ValueError(f"{key}: no file {path!r}")
        self.results_per_page, self.max_results = results_per_page, max_results
        self.max_query_chars = max_query_chars
        if goal_split is not None and not goal_split[0] < goal_split[1]:
            raise ValueError(f"goal_split must be (start, stop) with 0 <= start < stop, got {goal_split}")
        self.goal_split = goal_split
        self.reward_range = (0.0, 1.0)
        self._goal: Goal | None = None
        self._page = "search"
        self._query = ""
        self._results: list[str] = []
        self._page_no = 1
        self._asin: str | None = None
        self._chosen: dict[str, str] = {}
        self._bought: PurchaseScore | None = None

    @functools.cached_property
    def catalog(self) -> Catalog:
        """The product catalogue (built on first use, shared by envs of this process)."""
        products, attributes, human = self.paths
        if products is None:
            n = DEFAULT_PRODUCTS if self.num_products is None else self.num_products
            return get_generated_catalog(self.catalog_seed, n)
        return _cached_json_catalog(products, attributes, human, self.num_products, self.catalog_seed, os.getpid())

    @property
    def goal(self) -> Goal:
        if self._goal is None:
            raise RuntimeError("call reset() first")
        return self._goal

    # ------------------------------------------------------------------ actions
    def _clickables(self) -> list[str]:
        if self._page == "results":
            n_pages = max(1, -(-len(self._results) // self.results_per_page))
            out = [BACK] + ([PREV] if self._page_no > 1 else []) + ([NEXT] if self._page_no < n_pages else [])
            return out + [a.lower() for a in self._shown()]
        if self._page == "item":
            product = self.catalog.get(self._asin or "")
            values = [v for _, vs in (product.options if product else ()) for v in vs]
            return [BACK, PREV, BUY] + [v for i, v in enumerate(values) if v not in values[:i]]
        return []

    def _action_names(self) -> tuple[str, ...]:
        if self._page == "search":
            return ("search[<query>]",)
        return tuple(f"click[{c}]" for c in self._clickables())

    def match_action(self, text: object) -> str | None:
        """Canonical ``search[...]`` / ``click[...]`` for text valid on this page, else None."""
        if not isinstance(text, str):
            return None
        m = _ACTION.fullmatch(text.strip())
        if m is None:
            return None
        kind, arg = m.group(1).lower(), m.group(2).strip()
        if kind == "search":
            ok = self._page == "search" and len(arg) <= self.max_query_chars and bool(tokens(arg))
            return f"search[{arg}]" if ok else None
        key = " ".join(arg.casefold().split())
        for c in self._clickables():
            if c.casefold() == key:
                return f"click[{c}]"
        return None

    def sample_action(self, rng: np.random.Generator) -> str:
        """A random valid action; on the search page, a query of 1-5 words from the instruction."""
        if self._page == "search":
            words = tokens(self.goal.instruction) or ["item"]
            k = int(rng.integers(1, 6))
            return "search[" + " ".join(words[int(i)] for i in rng.integers(len(words), size=k)) + "]"
        return super().sample_action(rng)

    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        self._goal = make_goal(self.catalog, rng, self.goal_split)
        self._page, self._query, self._results, self._page_no = "search", "", [], 1
        self._asin, self._chosen, self._bought = None, {}, None
        return {"goal_asin": self._goal.asin, "price_upper": self._goal.price_upper}

    def _apply(self, action: str) -> StepOutcome:
        kind, arg = action.split("[", 1)
        arg = arg[:-1]
        if kind == "search":
            self._results = self.catalog.search(arg, self.max_results)
            self._query = " ".join(dict.fromkeys(tokens(arg)))[:100]
            self._page, self._page_no = "results", 1
            return StepOutcome(info={"page": self._page, "n_results": len(self._results)})
        if arg == BACK:
            self._page, self._query, self._results, self._asin, self._chosen = "search", "", [], None, {}
        elif arg == NEXT:
            self._page_no += 1
        elif arg == PREV and self._page == "results":
            self._page_no -= 1
        elif arg == PREV:
            self._page, self._asin, self._chosen = "results", None, {}
        elif arg == BUY:
            return self._buy()
        elif self._page == "results":
            self._page, self._asin, self._chosen = "item", arg.upper(), {}
        else:
            product = self.catalog.get(self._asin or "")
            name = next(n for n, vs in (product.options if product else ()) if arg in vs)
            changed = self._chosen.get(name) != arg
            self._chosen[name] = arg
            return StepOutcome(effective=changed, info={"page": self._page})
        return StepOutcome(info={"page": self._page})

    def _buy(self) -> StepOutcome:
        product = self.catalog.get(self._asin or "")
        assert product is not None and self._goal is not None
        score = score_purchase(product, self._goal, self._chosen)
        self._page, self._bought = "done", score
        return StepOutcome(
            reward=score.reward, terminated=True, success=score.reward >= 1.0 - 1e-9,
            info={"page": "done", "asin": product.asin, "options": dict(self._chosen),
                  "r_type": score.r_type, "attributes_matched": score.attributes_matched,
                  "options_matched": score.options_matched, "price_ok": score.price_ok},
        )

    def _state(self) -> Any:
        # The goal decides the instruction and the purchase reward; the rest is where the shopper is, with only what
        # the page can still show or return to: the search (query, results, page number) on the results and item
        # pages, the item and its options on the item and done pages. The chosen options keep their order: the
        # pages list them in the order they were picked.
        state: dict[str, Any] = {"goal": dataclasses.asdict(self._goal) if self._goal is not None else None,
                                 "page": self._page}
        if self._page in ("results", "item"):
            state.update(query=self._query, results=list(self._results), page_no=self._page_no)
        if self._page in ("item", "done"):
            state.update(asin=self._asin, chosen=[list(kv) for kv in self._chosen.items()])
        return state

    # ------------------------------------------------------------------ text
    def _instruction(self) -> str:
        return (
            "You are shopping in an online store. Each page shows your shopping instruction and the "
            "actions available. Search with search[your query], open items and press buttons with "
            "click[...], choose the options the instruction asks for, and buy the product that best "
            "matches the instruction, its options and its price limit."
        )

    def _shown(self) -> list[str]:
        start = (self._page_no - 1) * self.results_per_page
        return self._results[start:start + self.results_per_page]

    def render(self) -> str:
        if self._goal is None:
            return ""
        lines = [f"Instruction: {self._goal.instruction}"]
        if self._page == "search":
            lines.append("Page: search. Type a query to search the store.")
        elif self._page == "results":
            n_pages = max(1, -(-len(self._results) // self.results_per_page))
            lines.append(f'Page: results for "{self._query}" (page {self._page_no} of {n_pages}, '
                         f"{len(self._results)} results)")
            for asin in self._shown():
                p = self.catalog.get(asin)
                if p is not None:
                    lines.append(f"[{asin.lower()}] {p.title} | {p.price_text}")
        elif self._page == "item":
            p = self.catalog.get(self._asin or "")
            assert p is not None
            lines += [f"Page: item [{p.asin.lower()}]", p.title, f"Price: {p.price_text}",
                      f"Category: {p.product_category}", f"Description: {p.description}",
                      f"Features: {'; '.join(p.bullet_points)}"]
            for name, values in p.options:
                lines.append(f"Options for {name}: {', '.join(values)}")
            chosen = ", ".join(f"{k}: {v}" for k, v in self._chosen.items()) or "none"
            lines.append(f"Selected: {chosen}")
        else:
            p = self.catalog.get(self._asin or "")
            assert p is not None and self._bought is not None
            chosen = ", ".join(f"{k}: {v}" for k, v in self._chosen.items()) or "no options"
            lines += ["Page: purchase complete",
                      f"You bought [{p.asin.lower()}] {p.title} ({chosen}) for {p.price_text}.",
                      f"Score: {self._bought.reward:.3f}"]
            return "\n".join(lines)
        lines.append("Available actions: " + ", ".join(self._action_names()))
        return "\n".join(lines)
