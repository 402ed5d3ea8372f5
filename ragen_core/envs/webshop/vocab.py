"""Word lists for the generated WebShop catalogue (webshop/catalog.py draws from them with a seed).

Six departments, each with product types (WebShop's "query" field) and the attributes each
type can have (WebShop's instruction attributes: "machine wash", "gluten free", ...), a breadcrumb, option
dimensions with their values (size/colour/flavour...), title words, and a price range. Option
values are disjoint across the dimensions of one department, so ``click[value]`` is never
ambiguous on an item page.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BRANDS", "DEPARTMENTS", "FILLERS", "USES", "Department"]


@dataclass(frozen=True)
class Department:
    name: str
    """Top-level category (WebShop's ``category``)."""
    breadcrumb: str
    """First levels of ``product_category``; the product type is appended."""
    types: tuple[tuple[str, tuple[str, ...]], ...]
    """(product type, attributes it can have); the type is the product's ``query`` and is in its title."""
    options: tuple[tuple[str, tuple[str, ...]], ...]
    """(option name, possible values)."""
    styles: tuple[str, ...]
    """Words placed before the type in titles."""
    price: tuple[float, float]


DEPARTMENTS: tuple[Department, ...] = (
    Department(
        name="fashion",
        breadcrumb="Clothing, Shoes & Jewelry › Fashion",
        types=(
            ("t-shirt", ("machine wash", "short sleeve", "long sleeve", "slim fit", "relaxed fit",
                         "moisture wicking", "cotton spandex", "crew neck")),
            ("hoodie", ("machine wash", "long sleeve", "relaxed fit", "fleece lined", "drawstring closure",
                        "kangaroo pocket")),
            ("running shoes", ("lace up", "rubber sole", "breathable mesh", "lightweight", "arch support",
                               "non slip")),
            ("summer dress", ("machine wash", "short sleeve", "relaxed fit", "hand wash only", "v neck",
                              "flowy fit")),
            ("jeans", ("machine wash", "slim fit", "relaxed fit", "button closure", "stretch denim",
                       "high waist")),
            ("socks", ("machine wash", "moisture wicking", "cushioned sole", "cotton blend", "quick drying")),
            ("rain jacket", ("water resistant", "zip closure", "packable", "hooded", "lightweight",
                             "hand wash only")),
            ("polo shirt", ("machine wash", "short sleeve", "slim fit", "moisture wicking", "button closure",
                            "quick drying")),
        ),
        options=(("color", ("black", "white", "navy", "heather grey", "red", "olive green", "burgundy",
                            "light blue", "beige", "pink")),
                 ("size", ("x-small", "small", "medium", "large", "x-large", "xx-large", "large tall"))),
        styles=("Men's", "Women's", "Unisex", "Kids'", "Classic", "Athletic"),
        price=(8.0, 95.0),
    ),
    Department(
        name="beauty",
        breadcrumb="Beauty & Personal Care › Skin & Hair Care",
        types=(
            ("face moisturizer", ("paraben free", "fragrance free", "sensitive skin", "hyaluronic acid",
                                  "oil free", "dermatologist tested")),
            ("shampoo", ("sulfate free", "paraben free", "natural ingredients", "color safe", "travel size",
                         "dry scalp")),
            ("lipstick", ("long lasting", "cruelty free", "vegan", "matte finish", "easy to apply")),
            ("sunscreen", ("water resistant", "broad spectrum", "oil free", "reef safe", "sensitive skin",
                           "travel size")),
            ("hair oil", ("natural ingredients", "argan oil", "paraben free", "frizz control", "cruelty free")),
            ("nail polish", ("long lasting", "quick drying", "cruelty free", "vegan", "chip resistant")),
            ("body wash", ("sulfate free", "natural ingredients", "sensitive skin", "travel size",
                           "fragrance free")),
            ("face serum", ("hyaluronic acid", "vitamin c", "paraben free", "dermatologist tested",
                            "cruelty free", "oil free")),
        ),
        options=(("scent", ("unscented", "lavender", "coconut", "citrus", "rose", "vanilla", "eucalyptus")),
                 ("size", ("1 fl oz", "1.7 fl oz", "3.4 fl oz", "8 fl oz", "16 fl oz"))),
        styles=("Organic", "Professional", "Daily", "Luxury", "Gentle", "Hydrating"),
        price=(5.0, 60.0),
    ),
    Department(
        name="electronics",
        breadcrumb="Electronics › Accessories",
        types=(
            ("wireless earbuds", ("noise cancelling", "long battery life", "water resistant", "bluetooth 5.0",
                                  "wireless charging", "fast charging")),
            ("bluetooth speaker", ("water resistant", "long battery life", "bluetooth 5.0", "compact design",
                                   "deep bass")),
            ("phone charger", ("fast charging", "usb c", "compact design", "wireless charging", "plug and play")),
            ("usb c cable", ("fast charging", "braided nylon", "usb c", "high speed data transfer", "durable")),
            ("power bank", ("fast charging", "usb c", "long battery life", "compact design", "led display")),
            ("smart watch", ("water resistant", "heart rate monitor", "long battery life", "bluetooth 5.0",
                             "sleep tracking")),
            ("webcam", ("high definition", "plug and play", "built in microphone", "wide angle",
                        "privacy cover")),
            ("gaming mouse", ("ergonomic design", "rgb lighting", "plug and play", "adjustable dpi",
                              "wireless")),
        ),
        options=(("color", ("black", "white", "silver", "space gray", "blue", "rose gold")),
                 ("style", ("standard", "pro", "mini", "2 pack", "3 pack"))),
        styles=("Portable", "Premium", "Ultra", "Smart", "Titan", "Everyday"),
        price=(9.0, 150.0),
    ),
    Department(
        name="grocery",
        breadcrumb="Grocery & Gourmet Food › Pantry",
        types=(
            ("green tea", ("usda organic", "caffeine free", "non gmo", "kosher", "individually wrapped")),
            ("coffee beans", ("usda organic", "whole bean", "medium roast", "fair trade", "non gmo")),
            ("protein bar", ("high protein", "gluten free", "low carb", "keto friendly", "individually wrapped",
                             "plant based")),
            ("dark chocolate", ("sugar free", "non gmo", "keto friendly", "fair trade", "kosher")),
            ("olive oil", ("extra virgin", "usda organic", "non gmo", "cold pressed", "kosher")),
            ("granola", ("gluten free", "high protein", "non gmo", "plant based", "ready to eat")),
            ("trail mix", ("gluten free", "non gmo", "high protein", "individually wrapped", "ready to eat")),
            ("beef jerky", ("high protein", "low carb", "keto friendly", "gluten free", "ready to eat")),
        ),
        options=(("flavor", ("original", "vanilla", "chocolate", "sea salt", "honey", "mint", "spicy",
                             "maple")),
                 ("size", ("6 count", "12 count", "24 count", "8 ounce", "16 ounce", "32 ounce"))),
        styles=("Organic", "Gourmet", "Artisan", "Classic", "Premium", "Family"),
        price=(3.0, 45.0),
    ),
    Department(
        name="home",
        breadcrumb="Home & Kitchen › Decor & Bedding",
        types=(
            ("throw pillow cover", ("machine washable", "super soft", "hidden zipper", "living room",
                                    "double sided")),
            ("bath towel", ("machine washable", "super soft", "quick drying", "highly absorbent",
                            "cotton blend")),
            ("bed sheet set", ("machine washable", "deep pocket", "wrinkle free", "super soft", "breathable")),
            ("coffee mug", ("dishwasher safe", "microwave safe", "bpa free", "large capacity", "heat resistant")),
            ("storage basket", ("space saving", "foldable", "heavy duty", "eco friendly", "easy clean")),
            ("table lamp", ("energy efficient", "dimmable", "easy assemble", "living room", "usb port")),
            ("shower curtain", ("waterproof", "machine washable", "stain resistant", "easy clean",
                                "rust proof hooks")),
            ("area rug", ("non slip", "stain resistant", "easy clean", "living room", "low pile")),
        ),
        options=(("color", ("white", "grey", "beige", "navy blue", "sage green", "mustard yellow",
                            "charcoal", "terracotta")),
                 ("size", ("twin", "full", "queen", "king", "18 x 18 inch", "20 x 20 inch"))),
        styles=("Modern", "Farmhouse", "Boho", "Minimalist", "Vintage", "Cozy"),
        price=(7.0, 120.0),
    ),
    Department(
        name="sports",
        breadcrumb="Sports & Outdoors › Fitness & Camping",
        types=(
            ("yoga mat", ("non slip", "high density", "lightweight", "eco friendly", "easy to carry")),
            ("water bottle", ("leak proof", "bpa free", "double wall", "dishwasher safe", "keeps drinks cold")),
            ("camping tent", ("waterproof", "easy setup", "lightweight", "portable", "breathable")),
            ("hiking backpack", ("waterproof", "lightweight", "adjustable straps", "breathable", "durable")),
            ("resistance bands", ("portable", "durable", "non slip", "adjustable", "latex free")),
            ("dumbbell set", ("adjustable", "non slip", "durable", "space saving", "rubber coated")),
            ("sleeping bag", ("lightweight", "waterproof", "compact design", "machine washable", "portable")),
            ("jump rope", ("adjustable", "tangle free", "lightweight", "ball bearings", "portable")),
        ),
        options=(("color", ("black", "purple", "teal", "orange", "forest green", "slate grey", "red")),
                 ("size", ("small", "medium", "large", "20 oz", "32 oz", "40 oz"))),
        styles=("Outdoor", "Pro", "Trail", "Everyday", "Performance", "Active"),
        price=(6.0, 180.0),
    ),
)

BRANDS: tuple[str, ...] = (
    "Kestrel", "Nordvik", "Amberly", "Solano", "Brightwell", "Corvana", "Halden", "Mirola", "Pinecrest",
    "Quillon", "Ravelle", "Sundara", "Tavora", "Umbrio", "Velmont", "Wexley", "Yarrowby", "Zephra",
    "Lumio", "Ostara", "Brisa", "Calder", "Dunmore", "Elowen",
)

USES: tuple[str, ...] = (
    "everyday use", "travel", "the gym", "home and office", "gifts", "outdoor adventures",
    "busy mornings", "weekends", "the whole family", "work",
)

FILLERS: tuple[str, ...] = (
    "Backed by a 30-day satisfaction guarantee.",
    "Designed and tested by our in-house team.",
    "A customer favourite for years.",
    "Packed in recyclable packaging.",
    "Simple to care for and built to last.",
    "Great value for the quality.",
)
