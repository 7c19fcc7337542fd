"""Names for simulated repositories: domains, package and module names, quantities.

Every generated repository belongs to one domain (inventory, banking, geometry, ...), which
supplies its package name, module names, README wording and the quantities its functions
work on (`stock_levels`, `balances`, ...). Two domains are held out of training: they appear
only in the held-out split, so a policy cannot pass held-out tasks by recalling names.
This module only holds words; nothing here renders code.
"""

from __future__ import annotations

from dataclasses import dataclass
from random import Random


@dataclass(frozen=True)
class Quantity:
    plural: str                                # identifier for a list of them: "stock_levels"
    singular: str                              # identifier for one: "stock_level"
    human: str                                 # for docstrings: "stock levels"


@dataclass(frozen=True)
class Domain:
    key: str
    blurb: str                                 # README: "Small helpers for {blurb}."
    packages: tuple[str, ...]
    modules: tuple[str, ...]                   # module names (never "cli", "tests")
    quantities: tuple[Quantity, ...]
    texts: tuple[str, ...]                     # names for a string parameter
    heldout: bool = False


def _q(*specs: str) -> tuple[Quantity, ...]:
    out = []
    for spec in specs:
        plural, singular = spec.split("/")
        out.append(Quantity(plural, singular, plural.replace("_", " ")))
    return tuple(out)


DOMAINS: tuple[Domain, ...] = (
    Domain("inventory", "tracking warehouse stock", ("inventory", "stockroom", "warehouse",
           "stocktake"), ("stock", "orders", "levels", "suppliers", "restock", "catalog"),
           _q("quantities/quantity", "stock_levels/stock_level", "counts/count",
              "units/unit"), ("label", "sku_name", "description")),
    Domain("banking", "a small bank ledger", ("ledger", "bankbook", "accounts", "payments"),
           ("transactions", "balances", "statements", "transfers", "fees", "interest"),
           _q("amounts/amount", "balances/balance", "deposits/deposit", "payments/payment"),
           ("memo", "holder_name", "reference")),
    Domain("geometry", "plane geometry", ("geometry", "shapes", "planar", "geomkit"),
           ("polygons", "measures", "points", "areas", "segments", "angles"),
           _q("lengths/length", "sides/side", "widths/width", "radii/radius"),
           ("shape_name", "label", "caption")),
    Domain("text", "text statistics", ("textstats", "wordsmith", "prose", "corpus_tools"),
           ("counting", "tokens", "metrics", "documents", "cleanup", "summaries"),
           _q("word_counts/word_count", "line_lengths/line_length", "scores/score",
              "frequencies/frequency"), ("text", "sentence", "line")),
    Domain("scheduling", "shift scheduling", ("scheduler", "rota", "shiftplan", "agenda"),
           ("shifts", "slots", "calendar_utils", "timesheets", "planning", "availability"),
           _q("durations/duration", "minutes/minute", "hours/hour", "breaks/break_length"),
           ("title", "room_name", "note")),
    Domain("grades", "a school gradebook", ("gradebook", "classroom", "marksheet",
           "coursework"), ("scores", "students", "grading", "terms", "exams", "reports_util"),
           _q("scores/score", "marks/mark", "points/point", "results/result"),
           ("student_name", "comment", "course_title")),
    Domain("weather", "weather station readings", ("weather", "forecast", "meteo",
           "station"), ("readings", "sensors", "daily", "climate", "rain", "conversions"),
           _q("temperatures/temperature", "readings/reading", "rainfall/rain_mm",
              "wind_speeds/wind_speed"), ("station_name", "summary", "remark")),
    Domain("shipping", "parcel shipping", ("shipping", "logistics", "parcels", "freight"),
           ("rates", "routes", "packages", "tracking", "manifest", "zones"),
           _q("weights/weight", "distances/distance", "costs/cost", "volumes/volume"),
           ("address", "carrier", "destination")),
    Domain("fitness", "workout tracking", ("fitness", "workouts", "trainer_log", "pacing"),
           ("sessions", "activity", "progress", "heart", "steps", "goals"),
           _q("step_counts/step_count", "heart_rates/heart_rate", "calories/calorie",
              "laps/lap_time"), ("exercise", "athlete", "note")),
    Domain("recipes", "scaling recipes", ("kitchen", "recipes", "pantry", "cookbook"),
           ("ingredients", "portions", "menus", "nutrition", "shopping", "prep"),
           _q("servings/serving", "portions/portion", "grams/gram", "prices/price"),
           ("dish_name", "ingredient", "instructions")),
    # held out of training: only the held-out split draws these
    Domain("astronomy", "amateur astronomy logs", ("stargazer", "skylog", "observatory",
           "astro_tools"), ("observations", "catalogue", "orbits", "sky", "telescopes",
           "sessions"), _q("magnitudes/magnitude", "distances/distance",
                           "exposures/exposure", "altitudes/altitude"),
           ("object_name", "constellation", "remark"), heldout=True),
    Domain("music", "a music practice journal", ("practice", "setlist", "rehearsal",
           "tempo_tools"), ("pieces", "tempos", "sessions", "playlists", "tuning", "scales"),
           _q("tempos/tempo", "durations/duration", "ratings/rating", "plays/play_count"),
           ("song_title", "artist", "lyric"), heldout=True),
)


def domains_for(split: str) -> list[Domain]:
    """Training draws only the training domains; the held-out split draws from all."""
    return [d for d in DOMAINS if split == "heldout" or not d.heldout]


def pick(rng: Random, options, taken: set[str] | None = None):
    """A random option not in `taken` (strings), falling back to any option."""
    options = list(options)
    free = [o for o in options if taken is None or o not in taken]
    return rng.choice(free or options)
