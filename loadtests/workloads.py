"""Workload profiles for LLM load tests, generated offline and deterministically (no data downloaded).

The profiles are the workloads the seeds tell apart, because the serving features pay on different ones:

- `random`: prompts of random words of a set length, all distinct, so no prefix is shared (the baseline).
- `shared-prefix`: one long system prompt (~2,000 tokens by default, ~1,500 words) shared by every
  request of every user, then a short unique user turn: where prefix caching pays. With `prefix_count`
  N > 1 there are N such prompts (tenants, each its own text) and each request picks one at random:
  when N prompts outgrow one replica's KV cache but not the fleet's, routing decides the hit rate.
- `multi-turn`: chat conversations that grow turn by turn; each request resends the whole history
  (system prompt, earlier user turns and assistant replies), so turn t's prompt is a prefix of turn t+1's.
  The assistant replies in the history are synthetic (generated here, not the model's real answer), so
  the test set does not depend on what the server generated.
- `structured`: SQL from a schema, code from a signature and docstring, JSON extraction from a message:
  predictable output that repeats identifiers from the prompt, at temperature 0: where speculative
  decoding (ngram, draft model) pays.
- `creative`: open-ended prose (stories, poems, letters) at temperature 0.9: where speculation does not.

Lengths are set in approximate tokens and turned into a number of words with `tokens_per_word` (1.3 is
typical of BPE tokenizers on English text). Pass the server's real ratio to get the token counts you ask
for: the embedded tiny-qwen3's toy byte-level tokenizer spends about 4.5 tokens per word of these prompts,
so the defaults are 3.5 times longer there (the default shared prefix would not fit its 2,048-token
context; use tokens_per_word=4.5 and prefix_tokens=1500).

Everything is a pure function of (profile, seed, stream, options): `random.Random` seeded with a string
is reproducible across processes and Python versions 3.2+. `iter_requests` is an endless stream and
`make_requests` its first n items, so a longer run replays a shorter one's requests first. A load
generator gives each simulated user its own `stream` (its index), so users do not send identical prompts;
the shared system prompt comes from a constant seed, so it is the same text for every seed and stream.

The open-loop arrival schedule (`arrival_times`) and the step syntax shared by the load shapes
(`parse_steps`) live here too, so that they are pure and tested without Locust.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice
from typing import Any

PROFILES = ("random", "shared-prefix", "multi-turn", "structured", "creative")

DEFAULT_TOKENS_PER_WORD = 1.3
DEFAULT_MAX_TOKENS = {
    "random": 128,
    "shared-prefix": 64,
    "multi-turn": 128,
    "structured": 192,
    "creative": 384,
}
DEFAULT_INPUT_TOKENS = 256  # `random` prompt length
DEFAULT_PREFIX_TOKENS = 2000  # `shared-prefix` system prompt length
SHARED_PREFIX_SEED = 20261129  # constant: the shared prefix is one text whatever the seed or stream

STRUCTURED_TEMPERATURE = 0.0
CREATIVE_TEMPERATURE = 0.9
CREATIVE_TOP_P = 0.95

# --------------------------------------------------------------------------------------------------------
# Word pools (plain English, mostly one BPE token each)
# --------------------------------------------------------------------------------------------------------

WORDS = """
time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community name
team minute idea kid body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force education foot
boy age policy process music market sense nation plan college interest death experience effect use
class control care field development role effort rate heart drug show leader light voice wife police
mind price report decision son view relationship town road arm difference value building action model
season society tax director position player record paper space ground form event official matter
center couple site project activity star table need court oil situation cost industry figure street
image phone data picture practice piece land product doctor wall patient worker news test movie north
love support technology step baby computer type attention film tree source organization hair window
evidence population truth song energy shop memory river garden letter winter bridge summer island
""".split()

VERBS = """
check review update send read write build open close move keep start finish plan share track measure
compare explain describe record confirm cancel replace repair schedule deliver collect prepare approve
""".split()

ADJECTIVES = """
new old large small early late local general main public simple clear recent current final daily
weekly quiet busy careful quick slow bright dark warm cold open full empty short long strong light
""".split()

# --------------------------------------------------------------------------------------------------------
# Steps (concurrency ladder, arrival-rate steps) and the open-loop arrival schedule
# --------------------------------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


@dataclass(frozen=True)
class Step:
    """One step of a load plan: `value` users (ladder) or requests per second (arrival rate)."""

    value: float
    duration_s: float


def parse_duration_s(text: str) -> float:
    """'30' and '30s' -> 30.0, '2m' -> 120.0, '500ms' -> 0.5."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"bad duration {text!r}: expected a number with an optional unit ms, s, m or h")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def parse_steps(spec: str) -> list[Step]:
    """'1:30,4:30s,16:2m' -> [Step(1, 30), Step(4, 30), Step(16, 120)] (value:duration pairs)."""
    steps = []
    for part in (p for p in spec.split(",") if p.strip()):
        value, sep, duration = part.partition(":")
        if not sep:
            raise ValueError(f"bad step {part.strip()!r} in {spec!r}: expected VALUE:DURATION, e.g. 4:30s")
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"bad step value {value.strip()!r} in {spec!r}: expected a number") from None
        d = parse_duration_s(duration)
        if v < 0 or d <= 0:
            raise ValueError(f"bad step {part.strip()!r} in {spec!r}: value must be >= 0 and duration > 0")
        steps.append(Step(v, d))
    if not steps:
        raise ValueError(f"no steps in {spec!r}: expected e.g. '1:30,4:30,16:30'")
    return steps


def ladder_label(users: float) -> str:
    """How the raw file labels a concurrency-ladder step: 'c=16'."""
    return f"c={int(round(users))}"


def step_index_at(steps: Sequence[Step], t_s: float) -> int | None:
    """Index of the step running at `t_s` seconds after the start; None once the last step has ended."""
    end = 0.0
    for i, step in enumerate(steps):
        end += step.duration_s
        if t_s < end:
            return i
    return None


@dataclass(frozen=True)
class Arrival:
    index: int
    at_s: float  # seconds after the schedule's start
    step_index: int
    rate_rps: float


def arrival_times(steps: Sequence[Step], *, burstiness: float = 1.0, seed: int = 0) -> list[Arrival]:
    """Open-loop arrival times for piecewise-constant request rates (`Step.value` in requests/s).

    Inter-arrival gaps are gamma-distributed with shape `burstiness` and mean 1/rate, as in `vllm bench
    serve --burstiness`: 1.0 is a Poisson process; below 1 arrivals come in clumps with long gaps between
    (coefficient of variation 1/sqrt(burstiness)); above 1 they are more even. A step of rate 0 is a pause.
    Gaps restart at each step boundary (exact for Poisson, which is memoryless).
    """
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0 (1 = Poisson, < 1 burstier), got {burstiness}")
    rng = random.Random(f"arrivals:{seed}")
    out: list[Arrival] = []
    start = 0.0
    for i, step in enumerate(steps):
        end = start + step.duration_s
        if step.value > 0:
            t = start + rng.gammavariate(burstiness, 1.0 / (step.value * burstiness))
            while t < end:
                out.append(Arrival(len(out), t, i, step.value))
                t += rng.gammavariate(burstiness, 1.0 / (step.value * burstiness))
        start = end
    return out


# --------------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    tokens_per_word: float
    max_tokens: int | None
    input_tokens: int
    prefix_tokens: int
    prefix_count: int = 1

    def words(self, tokens: float) -> int:
        return max(1, round(tokens / self.tokens_per_word))


def render_prompt(messages: Sequence[dict[str, str]]) -> str:
    """A chat as one plain-text prompt for /v1/completions; a shared leading message stays a prefix."""
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _prose(rng: random.Random, n_words: int) -> str:
    """Sentence-shaped filler of about n_words words."""
    sentences: list[str] = []
    total = 0
    while total < n_words:
        k = min(rng.randint(8, 16), n_words - total)
        words = [rng.choice(WORDS) for _ in range(k)]
        if k >= 4:
            words[1] = rng.choice(ADJECTIVES)
            words[2] = rng.choice(VERBS)
        sentences.append(" ".join(words).capitalize() + ".")
        total += k
    return " ".join(sentences)


def _request(
    profile: str,
    ident: str,
    kind: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    rng: random.Random,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    conversation: str | None = None,
    turn: int = 1,
) -> dict[str, Any]:
    return {
        "id": ident,
        "profile": profile,
        "kind": kind,
        "messages": messages,
        "prompt": render_prompt(messages),
        "prompt_words": sum(len(m["content"].split()) for m in messages),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": rng.randrange(2**31),  # per-request sampling seed: reproducible output where it matters
        "conversation": conversation if conversation is not None else ident,
        "turn": turn,
    }


def _max_tokens(profile: str, opts: _Options) -> int:
    return opts.max_tokens if opts.max_tokens is not None else DEFAULT_MAX_TOKENS[profile]


def _gen_random(rng: random.Random, tag: str, opts: _Options) -> Iterator[dict[str, Any]]:
    n = opts.words(opts.input_tokens)
    for i in range(10**12):
        ident = f"{tag}-{i}"
        # The id leads the prompt: two prompts never share a first KV block, even by chance.
        content = f"[{ident}] " + _words(rng, n - 1)
        yield _request(
            "random",
            ident,
            "random",
            [{"role": "user", "content": content}],
            _max_tokens("random", opts),
            rng,
        )


@lru_cache(maxsize=4096)
def shared_system_prompt(
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS, tokens_per_word: float = 1.3, tenant: int = 0
) -> str:
    """The long system prompt of `shared-prefix`: an operations handbook, identical for every caller of
    the same tenant (tenant 0 is the one prompt of the default profile)."""
    rng = random.Random(f"shared-prefix:{SHARED_PREFIX_SEED}" + (f":{tenant}" if tenant else ""))
    n = max(1, round(prefix_tokens / tokens_per_word))
    company = "Northwind Logistics" if tenant == 0 else f"Northwind Logistics, tenant {tenant}"
    head = (
        f"You are the support assistant of {company}. Follow the handbook below exactly. "
        "Answer in at most three sentences and cite the section number you used.\n\n"
    )
    left = max(3, n - len(head.split()))
    sections: list[str] = []
    while left > 0:
        k = min(120, left)  # words in this section, its two-word "Section N." heading included
        sections.append(f"Section {len(sections) + 1}. {_prose(rng, max(1, k - 2))}")
        left -= k
    return head + "\n".join(sections)


QUESTION_TEMPLATES = (
    "Ticket {n}: a customer in {city} asks how to {verb} the {adj} {noun} for order {order}.",
    "Ticket {n}: can I {verb} my {noun} after the {adj} delivery window closed? Order {order}, {city}.",
    "Ticket {n}: which section covers a {adj} {noun} that arrived in {city}? Reference {order}.",
    "Ticket {n}: the driver in {city} could not {verb} the {noun}; what should the customer do? {order}",
)
CITIES = "Lisbon Osaka Denver Nairobi Oslo Lima Perth Quebec Seville Tallinn Hanoi Cork Graz Austin".split()


def _gen_shared_prefix(rng: random.Random, tag: str, opts: _Options) -> Iterator[dict[str, Any]]:
    for i in range(10**12):
        tenant = rng.randrange(opts.prefix_count) if opts.prefix_count > 1 else 0
        system = shared_system_prompt(opts.prefix_tokens, opts.tokens_per_word, tenant)
        question = rng.choice(QUESTION_TEMPLATES).format(
            n=f"{tag}-{i}",
            city=rng.choice(CITIES),
            verb=rng.choice(VERBS),
            adj=rng.choice(ADJECTIVES),
            noun=rng.choice(WORDS),
            order=f"NW-{rng.randrange(10**6):06d}",
        )
        extra = _words(rng, rng.randint(5, 15))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"{question} {extra}"}]
        yield _request(
            "shared-prefix", f"{tag}-{i}", "ticket", messages, _max_tokens("shared-prefix", opts), rng
        )


def _gen_multi_turn(rng: random.Random, tag: str, opts: _Options) -> Iterator[dict[str, Any]]:
    scale = DEFAULT_TOKENS_PER_WORD / opts.tokens_per_word  # history lengths are set for 1.3 tokens/word
    for c in range(10**12):
        conv = f"{tag}-c{c}"
        system = f"You are a helpful assistant in conversation {conv}. Be concise and friendly. " + _prose(
            rng, max(1, round(30 * scale))
        )
        history: list[dict[str, str]] = [{"role": "system", "content": system}]
        turns = rng.randint(3, 6)
        for t in range(1, turns + 1):
            user = f"Turn {t}. " + _prose(rng, max(1, round(rng.randint(20, 50) * scale)))
            messages = [*history, {"role": "user", "content": user}]
            yield _request(
                "multi-turn",
                f"{conv}-t{t}",
                "chat",
                messages,
                _max_tokens("multi-turn", opts),
                rng,
                conversation=conv,
                turn=t,
            )
            reply = _prose(rng, max(1, round(rng.randint(60, 120) * scale)))
            history = [*messages, {"role": "assistant", "content": reply}]


# Structured: SQL, code, JSON extraction. The outputs repeat names from the prompt (what ngram drafts from).

TABLES = {
    "customers": ["customer_id", "name", "email", "city", "country", "created_at", "segment"],
    "orders": ["order_id", "customer_id", "order_date", "status", "total_amount", "currency", "channel"],
    "order_items": ["order_id", "product_id", "quantity", "unit_price", "discount"],
    "products": ["product_id", "title", "category", "brand", "list_price", "weight_kg"],
    "shipments": ["shipment_id", "order_id", "carrier", "shipped_at", "delivered_at", "warehouse_id"],
    "warehouses": ["warehouse_id", "city", "country", "capacity", "manager"],
}
SQL_ASKS = (
    "the total {num} per {group} for {status} orders placed since {date}, highest first",
    "the 10 {group} values with the largest average {num} in {year}",
    "for each {group}, the number of distinct customers and the sum of {num}, only where the sum exceeds {n}",
    "the month-by-month count of orders and the running total of {num} for {year}",
)
FUNCTIONS = (
    ("moving_average", "values: list[float], window: int", "list[float]", "the simple moving average"),
    (
        "merge_intervals",
        "intervals: list[tuple[int, int]]",
        "list[tuple[int, int]]",
        "overlapping intervals merged",
    ),
    ("parse_duration", "text: str", "int", "the number of seconds in a duration such as '1h30m'"),
    ("top_k_words", "text: str, k: int", "list[tuple[str, int]]", "the k most frequent words with counts"),
    ("is_valid_isbn10", "code: str", "bool", "whether code is a valid ISBN-10"),
    ("group_by_key", "rows: list[dict], key: str", "dict[str, list[dict]]", "the rows grouped by rows[key]"),
    ("rle_encode", "data: str", "list[tuple[str, int]]", "the run-length encoding of data"),
    ("percentile", "values: list[float], q: float", "float", "the linearly interpolated q-th percentile"),
)
JSON_FIELDS = ("customer_name", "order_id", "order_date", "city", "product", "quantity", "amount", "issue")
FIRST = "Ana Ben Chloe Dmitri Elif Farid Grace Hiro Ines Jonas Kira Luca Maya Nils Omar Priya".split()
LAST = "Silva Okafor Novak Tanaka Larsen Moreau Haddad Kowalski Reyes Berg Costa Ivanova".split()
PRODUCTS = "kettle backpack monitor blender headphones lamp jacket router drill chair tent scale".split()
ISSUES = (
    "arrived damaged",
    "was never delivered",
    "is the wrong colour",
    "stopped working",
    "was charged twice",
)


def _sql(rng: random.Random) -> tuple[str, str]:
    names = rng.sample(sorted(TABLES), rng.randint(2, 4))
    schema = "\n".join(f"CREATE TABLE {t} ({', '.join(TABLES[t])});" for t in names)
    cols = [c for t in names for c in TABLES[t]]
    ask = rng.choice(SQL_ASKS).format(
        num=rng.choice(
            [c for c in cols if c.endswith(("amount", "price", "quantity", "capacity", "kg"))] or cols
        ),
        group=rng.choice(cols),
        status=rng.choice(["shipped", "delivered", "cancelled", "open"]),
        date=f"2026-{rng.randint(1, 12):02d}-01",
        year=rng.randint(2022, 2026),
        n=rng.randint(10, 99) * 100,
    )
    user = (
        f"Schema:\n{schema}\n\nWrite one PostgreSQL query that returns {ask}. "
        "Use explicit JOIN ... ON clauses and the table names above as aliases."
    )
    return "sql", user


def _code(rng: random.Random) -> tuple[str, str]:
    name, params, ret, what = rng.choice(FUNCTIONS)
    arg = params.split(":")[0]
    user = (
        f"Implement this Python function. Keep the signature and docstring, add type hints, and add three "
        f"pytest test functions named test_{name}_basic, test_{name}_empty and test_{name}_edge.\n\n"
        f"def {name}({params}) -> {ret}:\n"
        f'    """Return {what}.\n\n    Raises ValueError if {arg} is invalid.\n    """\n'
    )
    return "code", user


def _json(rng: random.Random) -> tuple[str, str]:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    qty = rng.randint(1, 5)
    fields = {
        "customer_name": f"{first} {last}",
        "order_id": f"NW-{rng.randrange(10**6):06d}",
        "order_date": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        "city": rng.choice(CITIES),
        "product": rng.choice(PRODUCTS),
        "quantity": str(qty),
        "amount": f"{qty * rng.randint(15, 400)}.{rng.randint(0, 99):02d}",
        "issue": rng.choice(ISSUES),
    }
    f = fields
    message = (
        f"Hello, this is {f['customer_name']} from {f['city']}. On {f['order_date']} I ordered "
        f"{f['quantity']} x {f['product']} (order {f['order_id']}, {f['amount']} EUR) and "
        f"it {f['issue']}. {_prose(rng, rng.randint(10, 25))}"
    )
    template = "{" + ", ".join(f'"{k}": ...' for k in JSON_FIELDS) + "}"
    user = (
        f"Extract these fields from the customer message and answer with one JSON object with exactly "
        f"these keys, strings for every value: {template}\n\nMessage: {message}"
    )
    return "json", user


STRUCTURED_SYSTEM = (
    "You are a precise assistant for developers. Answer with the requested artifact only (SQL, Python or "
    "JSON), in one fenced code block, with no explanation."
)


def _gen_structured(rng: random.Random, tag: str, opts: _Options) -> Iterator[dict[str, Any]]:
    makers = (_sql, _code, _json)
    for i in range(10**12):
        kind, user = makers[i % len(makers)](rng)  # an even mix, in a fixed order
        messages = [{"role": "system", "content": STRUCTURED_SYSTEM}, {"role": "user", "content": user}]
        yield _request(
            "structured",
            f"{tag}-{i}",
            kind,
            messages,
            _max_tokens("structured", opts),
            rng,
            temperature=STRUCTURED_TEMPERATURE,
        )


FORMS = (
    "a short story",
    "a poem in free verse",
    "a letter",
    "a dramatic monologue",
    "a fable",
    "a diary entry",
)
SUBJECTS = (
    "a lighthouse keeper who finds a message in a bottle",
    "the last bookshop in a flooded city",
    "two rival bakers forced to share an oven",
    "a robot learning to garden",
    "a night train crossing a border",
    "a grandmother teaching chess to a ghost",
    "the day the sea went quiet",
    "a cartographer mapping a town that keeps moving",
)
MOODS = ("melancholy", "playful", "tense", "hopeful", "eerie", "tender", "absurd")
CONSTRAINTS = (
    "Use vivid sensory detail.",
    "End with an unexpected twist.",
    "Write in the second person.",
    "Include a line of dialogue in every paragraph.",
    "Do not use the letter z.",
    "Let the weather mirror the emotions.",
)


def _gen_creative(rng: random.Random, tag: str, opts: _Options) -> Iterator[dict[str, Any]]:
    for i in range(10**12):
        user = (
            f"Write {rng.choice(FORMS)} about {rng.choice(SUBJECTS)}, in a {rng.choice(MOODS)} tone, set in "
            f"{rng.choice(CITIES)} in {rng.choice(['spring', 'summer', 'autumn', 'winter'])}. "
            f"{rng.choice(CONSTRAINTS)} Work in these words: {', '.join(rng.sample(WORDS, 4))}."
        )
        messages = [
            {"role": "system", "content": "You are an imaginative writer with a distinctive voice."},
            {"role": "user", "content": user},
        ]
        yield _request(
            "creative",
            f"{tag}-{i}",
            "prose",
            messages,
            _max_tokens("creative", opts),
            rng,
            temperature=CREATIVE_TEMPERATURE,
            top_p=CREATIVE_TOP_P,
        )


_GENERATORS = {
    "random": _gen_random,
    "shared-prefix": _gen_shared_prefix,
    "multi-turn": _gen_multi_turn,
    "structured": _gen_structured,
    "creative": _gen_creative,
}


def iter_requests(
    profile: str,
    seed: int = 0,
    *,
    stream: int = 0,
    max_tokens: int | None = None,
    tokens_per_word: float = DEFAULT_TOKENS_PER_WORD,
    input_tokens: int = DEFAULT_INPUT_TOKENS,
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
    prefix_count: int = 1,
) -> Iterator[dict[str, Any]]:
    """The endless, deterministic request stream of one (profile, seed, stream).

    Each item: id, profile, kind, messages (OpenAI chat messages), prompt (the same as one text, for
    /v1/completions), prompt_words, max_tokens, temperature, top_p, seed (per-request sampling seed),
    conversation and turn (multi-turn; single-turn requests are their own conversation, turn 1).
    `max_tokens` overrides the profile's default; `input_tokens` sets `random`'s prompt length and
    `prefix_tokens` the shared system prompt's, both in tokens at `tokens_per_word`; `prefix_count`
    how many distinct system prompts `shared-prefix` draws from.
    """
    if profile not in _GENERATORS:
        raise ValueError(f"unknown profile {profile!r}; expected one of {', '.join(PROFILES)}")
    if tokens_per_word <= 0:
        raise ValueError(f"tokens_per_word must be > 0, got {tokens_per_word}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if prefix_count < 1:
        raise ValueError(f"prefix_count must be >= 1, got {prefix_count}")
    opts = _Options(tokens_per_word, max_tokens, input_tokens, prefix_tokens, prefix_count)
    rng = random.Random(f"{profile}:{seed}:{stream}")
    return _GENERATORS[profile](rng, f"s{seed}u{stream}", opts)


def make_requests(profile: str, n: int, seed: int, **options: Any) -> list[dict[str, Any]]:
    """The first `n` requests of `iter_requests(profile, seed, **options)`."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return list(islice(iter_requests(profile, seed, **options), n))
