"""Deterministic JSON schemas for testing and benchmarking constrained (structured) decoding.

`generate_schemas(count, seed)` returns `count` small, varied JSON schemas of the kind clients
send with ``response_format = {"type": "json_schema", ...}``: nested objects (depth up to 3),
arrays of scalars and of objects (sometimes with ``minItems`` / ``maxItems``), string enums,
integers and numbers with ``minimum`` / ``maximum``, booleans, strings (sometimes with
``maxLength``), required and optional properties, and ``"additionalProperties": false`` on
every object (what OpenAI's strict mode requires). Property names are plain English words.

Every schema is small enough that a 135M model can write an instance within ~120 tokens most of
the time: 3-6 properties at the top level, 2-3 in nested objects, arrays of at most 3 objects.
Properties are listed in the order a grammar engine expects them (schema order).

`sample_instance(schema, rng)` builds a valid instance of a schema produced here (it handles
only the keywords these schemas use); tests and benchmarks use it as a known-good completion.

The output depends only on ``(count, seed)``: schema ``i`` is built from its own RNG, so
``generate_schemas(10)`` is a prefix of ``generate_schemas(50)``.
"""

from __future__ import annotations

import random
from typing import Any

Schema = dict[str, Any]

# Property names per kind of value. Pools are large enough that an object never runs out.
STRING_NAMES = (
    "name",
    "city",
    "title",
    "country",
    "street",
    "author",
    "company",
    "brand",
    "label",
    "summary",
    "note",
    "comment",
    "language",
    "website",
    "phone",
    "email",
    "nickname",
    "model",
)
ENUMS: dict[str, tuple[str, ...]] = {
    "status": ("active", "inactive", "pending"),
    "color": ("red", "green", "blue", "yellow"),
    "size": ("small", "medium", "large"),
    "priority": ("low", "medium", "high"),
    "category": ("books", "music", "games", "tools"),
    "mood": ("happy", "sad", "calm", "angry"),
    "unit": ("metric", "imperial"),
    "day": ("monday", "tuesday", "wednesday", "thursday", "friday"),
    "level": ("beginner", "intermediate", "expert"),
    "gender": ("female", "male", "other"),
    "weather": ("sunny", "cloudy", "rainy", "snowy"),
    "currency": ("usd", "eur", "gbp", "jpy"),
}
INTEGER_NAMES: dict[str, tuple[int, int]] = {
    "age": (0, 120),
    "count": (0, 1000),
    "year": (1900, 2100),
    "quantity": (1, 99),
    "score": (0, 100),
    "rank": (1, 50),
    "floor": (0, 80),
    "pages": (1, 2000),
    "rating": (1, 5),
    "minutes": (0, 59),
    "seats": (1, 9),
}
NUMBER_NAMES: dict[str, tuple[float, float]] = {
    "price": (0.0, 1000.0),
    "weight": (0.0, 200.0),
    "height": (0.0, 3.0),
    "temperature": (-50.0, 60.0),
    "latitude": (-90.0, 90.0),
    "longitude": (-180.0, 180.0),
    "distance": (0.0, 500.0),
    "ratio": (0.0, 1.0),
}
BOOLEAN_NAMES = (
    "active",
    "verified",
    "available",
    "enabled",
    "urgent",
    "public",
    "paid",
    "married",
    "remote",
    "vegan",
)
SCALAR_ARRAY_NAMES = ("tags", "keywords", "aliases", "hobbies", "skills", "labels", "topics")
NUMBER_ARRAY_NAMES = ("scores", "readings", "ratings", "sizes")
OBJECT_ARRAY_NAMES = ("items", "members", "stops", "steps", "contacts", "friends", "orders")
OBJECT_NAMES = (
    "address",
    "owner",
    "location",
    "details",
    "dimensions",
    "settings",
    "contact",
    "profile",
    "manager",
    "origin",
)
WORDS = (
    "alpha",
    "river",
    "stone",
    "maple",
    "echo",
    "lunar",
    "amber",
    "cedar",
    "delta",
    "harbor",
    "nova",
    "orbit",
    "pixel",
    "quartz",
    "sierra",
    "tango",
    "violet",
    "willow",
    "zephyr",
    "paris",
    "lima",
    "oslo",
    "rome",
    "tokyo",
    "cairo",
    "bob",
    "alice",
    "carol",
    "dave",
)

SCALAR_KINDS = ("string", "enum", "integer", "number", "boolean")


class _Names:
    """Hands out property names of one object without repeats."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def pick(self, rng: random.Random, pool: Any) -> str:
        free = [n for n in pool if n not in self.used]
        name = rng.choice(free)
        self.used.add(name)
        return name


def _string(rng: random.Random) -> Schema:
    schema: Schema = {"type": "string"}
    if rng.random() < 0.4:
        schema["maxLength"] = rng.choice((8, 12, 16, 24, 40))
    return schema


def _scalar(rng: random.Random, names: _Names, kind: str) -> tuple[str, Schema]:
    if kind == "string":
        return names.pick(rng, STRING_NAMES), _string(rng)
    if kind == "enum":
        name = names.pick(rng, ENUMS)
        return name, {"type": "string", "enum": list(ENUMS[name])}
    if kind == "integer":
        name = names.pick(rng, INTEGER_NAMES)
        lo, hi = INTEGER_NAMES[name]
        schema: Schema = {"type": "integer", "minimum": lo}
        if rng.random() < 0.8:
            schema["maximum"] = hi
        return name, schema
    if kind == "number":
        name = names.pick(rng, NUMBER_NAMES)
        lo, hi = NUMBER_NAMES[name]
        schema = {"type": "number"}
        if rng.random() < 0.85:
            schema["minimum"] = lo
        if rng.random() < 0.85:
            schema["maximum"] = hi
        return name, schema
    if kind == "boolean":
        return names.pick(rng, BOOLEAN_NAMES), {"type": "boolean"}
    raise ValueError(kind)


def _array_bounds(rng: random.Random, schema: Schema, always_max: bool) -> Schema:
    if always_max or rng.random() < 0.6:
        schema["maxItems"] = rng.randint(1, 3)
    if rng.random() < 0.4:
        schema["minItems"] = rng.randint(0, min(2, schema.get("maxItems", 2)))
    return schema


def _scalar_array(rng: random.Random, names: _Names) -> tuple[str, Schema]:
    if rng.random() < 0.7:
        name = names.pick(rng, SCALAR_ARRAY_NAMES)
        items = {"type": "string", "maxLength": 12} if rng.random() < 0.3 else {"type": "string"}
        if rng.random() < 0.3:
            items = {"type": "string", "enum": list(rng.choice(list(ENUMS.values())))}
    else:
        name = names.pick(rng, NUMBER_ARRAY_NAMES)
        items = rng.choice(({"type": "integer", "minimum": 0, "maximum": 100}, {"type": "number"}))
    return name, _array_bounds(rng, {"type": "array", "items": items}, always_max=False)


def _object(
    rng: random.Random, n_props: int, depth: int, max_depth: int, want: tuple[str, ...] = ()
) -> Schema:
    """An object of `n_props` properties at nesting `depth` (the top level is 1).

    `want` lists kinds that must appear (used to spread features over the schemas); the rest
    are drawn at random, composite kinds only while the depth allows and rarely below the top.
    """
    names = _Names()
    kinds = list(want)[:n_props]
    while len(kinds) < n_props:
        r = rng.random()
        nested_ok = depth < max_depth
        if nested_ok and r < (0.2 if depth == 1 else 0.1):
            kinds.append("object")
        elif nested_ok and r < (0.3 if depth == 1 else 0.15):
            kinds.append("object_array")
        elif depth == 1 and r < 0.42:
            kinds.append("scalar_array")
        else:
            kinds.append(rng.choice(SCALAR_KINDS))
    # At most one composite child below the top level keeps instances short.
    if depth > 1:
        composite = [i for i, k in enumerate(kinds) if k in ("object", "object_array")]
        for i in composite[1:]:
            kinds[i] = rng.choice(SCALAR_KINDS)
    rng.shuffle(kinds)

    properties: dict[str, Schema] = {}
    for kind in kinds:
        if kind == "object":
            name = names.pick(rng, OBJECT_NAMES)
            properties[name] = _object(rng, rng.randint(2, 3), depth + 1, max_depth)
        elif kind == "object_array":
            name = names.pick(rng, OBJECT_ARRAY_NAMES)
            item = _object(rng, rng.randint(2, 3), depth + 1, min(max_depth, depth + 1))
            properties[name] = _array_bounds(rng, {"type": "array", "items": item}, always_max=True)
        elif kind == "scalar_array":
            name, schema = _scalar_array(rng, names)
            properties[name] = schema
        else:
            name, schema = _scalar(rng, names, kind)
            properties[name] = schema

    # Usually most properties are required; sometimes all (OpenAI strict mode), sometimes few.
    mode = rng.random()
    if mode < 0.35:
        required = list(properties)
    else:
        p = 0.75 if mode < 0.85 else 0.35
        required = [n for n in properties if rng.random() < p]
        if not required:
            required = [next(iter(properties))]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


# Features each schema is made to contain, by index mod len: every feature recurs every few
# schemas whatever the RNG draws; the last entry leaves the schema fully random.
_THEMES: tuple[tuple[tuple[str, ...], int], ...] = (
    (("object", "enum", "integer"), 3),  # nested objects, depth 3
    (("object_array", "string", "boolean"), 2),
    (("scalar_array", "enum", "number"), 2),
    (("integer", "number", "boolean", "string"), 2),
    (("object", "scalar_array"), 3),
    ((), 3),
)


def generate_schemas(count: int = 50, seed: int = 0) -> list[dict]:
    """`count` varied, small, valid JSON schemas (Draft 2020-12), deterministic in `seed`."""
    schemas = []
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        want, max_depth = _THEMES[i % len(_THEMES)]
        n_props = rng.randint(max(3, len(want)), 6)
        schema = _object(rng, n_props, 1, max_depth, want)
        if max_depth == 3 and "object" in want:
            _deepen(rng, schema)
        schemas.append(schema)
    return schemas


def _deepen(rng: random.Random, schema: Schema) -> None:
    """Make sure one nested object of `schema` itself holds an object (depth 3)."""
    for prop in schema["properties"].values():
        if prop.get("type") != "object":
            continue
        inner = prop["properties"]
        if any(p.get("type") in ("object", "array") for p in inner.values()):
            return  # already deep enough (or holding an array, kept short)
        names = _Names()
        names.used.update(inner)
        name = names.pick(rng, OBJECT_NAMES)
        inner[name] = _object(rng, 2, 3, 3)
        if rng.random() < 0.7:
            prop["required"].append(name)
        return


def _number(rng: random.Random, schema: Schema) -> float:
    lo = schema.get("minimum", -100.0)
    hi = schema.get("maximum", lo + 200.0 if "minimum" in schema else 100.0)
    value = round(rng.uniform(lo, hi), 2)
    return min(max(value, lo), hi)


def sample_instance(schema: Schema, rng: random.Random) -> Any:
    """A random instance of `schema` (as made by `generate_schemas`), valid against it.

    Objects list their properties in schema order: every required one, each optional one
    with probability one half.
    """
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        required = set(schema.get("required", ()))
        return {
            name: sample_instance(sub, rng)
            for name, sub in schema.get("properties", {}).items()
            if name in required or rng.random() < 0.5
        }
    if kind == "array":
        lo = schema.get("minItems", 0)
        hi = schema.get("maxItems", max(lo, 3))
        return [sample_instance(schema["items"], rng) for _ in range(rng.randint(lo, hi))]
    if kind == "string":
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 2)))
        return text[: schema["maxLength"]] if "maxLength" in schema else text
    if kind == "integer":
        lo = schema.get("minimum", -1000)
        return rng.randint(lo, schema.get("maximum", lo + 1000))
    if kind == "number":
        return _number(rng, schema)
    if kind == "boolean":
        return rng.random() < 0.5
    raise ValueError(f"unsupported schema: {schema!r}")
