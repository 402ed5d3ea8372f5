"""Offline WebShop (SPEC §2): a seeded catalogue searched with SQLite FTS5, or the original JSON files.

    from ragen_core.envs import make
    env = make("WebShop"); obs, info = env.reset(seed=0)

Modules: catalog (records, generator, search), reward (purchase score), loader (original
WebShop JSON), env (pages and actions), vocab (word lists).
"""

from ragen_core.envs.webshop.catalog import Catalog, Goal, Product, fts_query, generate_catalog, make_goal
from ragen_core.envs.webshop.env import WebShopEnv
from ragen_core.envs.webshop.loader import load_webshop_json
from ragen_core.envs.webshop.reward import PurchaseScore, score_purchase

__all__ = ["Catalog", "Goal", "Product", "PurchaseScore", "WebShopEnv", "fts_query", "generate_catalog",
           "load_webshop_json", "make_goal", "score_purchase"]
