"""The bank of small, pure functions that simulated repositories are made of.

A `Kernel` is a function template: its code, docstring, argument generator and the bugs that
can be planted in it (wrong operator, off-by-one, wrong constant, inverted condition). Names
are placeholders (`$f` the function, `$P` a list of the domain's quantity, `$S` one of them,
other roles from `ROLES`), so one kernel reads as `total_stock_levels(stock_levels)` in an
inventory package and `sum_deposits(deposits)` in a ledger. Expected values are never written
by hand: `learner.tasks.repo` executes the rendered code. Kernels marked `heldout` appear only
in the held-out split. This module holds data only; rendering lives in `repo.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from random import Random
from typing import Callable


@dataclass(frozen=True)
class Bug:
    kind: str                                  # operator | off_by_one | constant | condition
    old: str                                   # template text, found once in the code
    new: str                                   # what the bug puts there instead


@dataclass(frozen=True)
class Kernel:
    key: str
    names: tuple[str, ...]                     # function name templates
    code: str                                  # `def $f(...):` line and body (no docstring)
    doc: str                                   # docstring template
    gen: Callable[[Random], tuple]             # random arguments
    bugs: tuple[Bug, ...] = ()
    edge: tuple[tuple, ...] = ()               # arguments always tested
    roles: dict[str, tuple] = field(default_factory=dict)   # extra placeholder choices
    imports: tuple[str, ...] = ()
    domains: tuple[str, ...] = ()              # empty: fits any domain
    heldout: bool = False
    label: str = ""                            # set for kernels over one list of numbers:
                                               # what a report line calls the result


# Placeholder choices shared by kernels; "a,b" keys pick a matching pair.
ROLES: dict[str, tuple] = {
    "t": ("limit", "threshold", "cutoff", "minimum"),
    "n": ("n", "count", "k", "how_many"),
    "acc": ("total", "result", "acc", "running"),
    "lo,hi": (("low", "high"), ("lo", "hi"), ("minimum", "maximum"), ("floor", "ceiling")),
    "i": ("i", "idx", "pos"),
    "best": ("best", "best_index", "top"),
}


def _ints(rng: Random, lo: int = -5, hi: int = 60, n: tuple[int, int] = (1, 7)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _words(rng: Random, n: tuple[int, int] = (1, 5)) -> str:
    words = ["alpha", "bravo", "cargo", "delta", "ember", "frost", "glade", "harbor", "ivory",
             "jade", "kilo", "lumen", "maple", "north", "oak", "pixel", "quartz", "river",
             "sable", "tide", "umber", "vale", "willow", "yarrow", "zephyr", "ox", "sun"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(*n)))


def _mixed_case(rng: Random) -> str:
    return " ".join(w.upper() if rng.random() < 0.3 else w for w in _words(rng, (2, 4)).split())


def _count_above_args(rng: Random) -> tuple:
    xs = _ints(rng, 0, 40, (2, 7))
    return xs, rng.choice(xs) if rng.random() < 0.6 else rng.randint(0, 40)


def _with_tie(rng: Random) -> tuple:
    xs = _ints(rng, 0, 30, (2, 7))
    if rng.random() < 0.5:
        xs.insert(rng.randrange(len(xs) + 1), max(xs))
    return (xs,)


KERNELS: tuple[Kernel, ...] = (
    Kernel("total", ("total_$P", "sum_$P", "${S}_total"), """\
def $f($P):
    $acc = 0
    for $S in $P:
        $acc += $S
    return $acc
""", "Return the sum of the $Ph (0 for an empty list).", lambda r: (_ints(r),),
        (Bug("operator", "$acc += $S", "$acc -= $S"), Bug("constant", "$acc = 0", "$acc = 1")),
        edge=(([],), ([4, 5],)), label="total"),
    Kernel("average", ("average_$S", "mean_$S", "${S}_average"), """\
def $f($P):
    if not $P:
        return 0.0
    return sum($P) / len($P)
""", "Return the mean of the $Ph, or 0.0 when there are none.", lambda r: (_ints(r),),
        (Bug("condition", "if not $P:", "if $P:"),
         Bug("off_by_one", "/ len($P)", "/ (len($P) - 1)")),
        edge=(([],), ([2, 4, 9],)), label="average"),
    Kernel("count_above", ("count_${P}_above", "num_${P}_over", "${P}_above_count"), """\
def $f($P, $t):
    $acc = 0
    for $S in $P:
        if $S > $t:
            $acc += 1
    return $acc
""", "Return how many of the $Ph are strictly greater than `$t`.", _count_above_args,
        (Bug("operator", "if $S > $t:", "if $S >= $t:"),
         Bug("condition", "if $S > $t:", "if $S < $t:")),
        edge=(([3, 5, 5, 8], 5),)),
    Kernel("clamp", ("clamp_$S", "bound_$S", "limit_$S"), """\
def $f($S, $lo, $hi):
    if $S < $lo:
        return $lo
    if $S > $hi:
        return $hi
    return $S
""", "Limit `$S` to the range from `$lo` to `$hi` (both included).",
        lambda r: (r.randint(-20, 120), r.randint(0, 30), r.randint(50, 100)),
        (Bug("operator", "if $S < $lo:", "if $S > $lo:"),
         Bug("condition", "if $S > $hi:\n        return $hi", "if $S > $hi:\n        return $lo")),
        edge=((-5, 0, 10), (15, 0, 10), (7, 0, 10))),
    Kernel("percent_change", ("percent_change", "${S}_change_percent", "growth_percent"), """\
def $f($old, $new):
    if $old == 0:
        return 0.0
    return round(($new - $old) / $old * 100, 2)
""", "Return the change from `$old` to `$new` in percent, rounded to 2 decimals "
        "(0.0 when `$old` is 0).", lambda r: (r.randint(1, 200), r.randint(0, 300)),
        (Bug("constant", "* 100, 2)", "* 10, 2)"),
         Bug("operator", "($new - $old)", "($old - $new)")),
        edge=((50, 75), (0, 10)),
        roles={"old,new": (("old", "new"), ("before", "after"), ("previous", "current"))}),
    Kernel("last_n", ("last_$P", "recent_$P", "latest_$P"), """\
def $f($P, $n):
    if $n <= 0:
        return []
    return $P[-$n:]
""", "Return the last `$n` $Ph (all of them when there are fewer; none when `$n` <= 0).",
        lambda r: (_ints(r, 0, 50, (1, 7)), r.randint(0, 8)),
        (Bug("off_by_one", "$P[-$n:]", "$P[-$n + 1:]"),
         Bug("condition", "if $n <= 0:", "if $n >= 0:")),
        edge=(([1, 2, 3, 4], 2), ([5, 6], 1))),
    Kernel("sum_between", ("sum_between", "inclusive_sum", "sum_from_to"), """\
def $f($lo, $hi):
    $acc = 0
    for $i in range($lo, $hi + 1):
        $acc += $i
    return $acc
""", "Return the sum of the integers from `$lo` to `$hi`, both included.",
        lambda r: (r.randint(-5, 10), r.randint(10, 30)),
        (Bug("off_by_one", "range($lo, $hi + 1)", "range($lo, $hi)"),
         Bug("operator", "$acc += $i", "$acc += 1")), edge=((1, 4),)),
    Kernel("argmax", ("index_of_max_$S", "peak_${S}_index", "argmax_$P"), """\
def $f($P):
    $best = 0
    for $i in range(1, len($P)):
        if $P[$i] > $P[$best]:
            $best = $i
    return $best
""", "Return the position of the largest of the $Ph (the first one on ties).", _with_tie,
        (Bug("operator", "if $P[$i] > $P[$best]:", "if $P[$i] >= $P[$best]:"),
         Bug("off_by_one", "range(1, len($P))", "range(1, len($P) - 1)")),
        edge=(([3, 9, 9, 1],), ([1, 2, 5],))),
    Kernel("median", ("median_$S", "middle_$S"), """\
def $f($P):
    ordered = sorted($P)
    mid = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2
""", "Return the median of the $Ph (the mean of the two middle values for an even count).",
        lambda r: (_ints(r, 0, 50, (1, 7)),),
        (Bug("off_by_one", "(ordered[mid - 1] + ordered[mid])", "(ordered[mid] + ordered[mid + 1])"),
         Bug("condition", "% 2 == 1:", "% 2 == 0:")),
        edge=(([4, 1, 3, 2],), ([5, 1, 9],)), heldout=True, label="median"),
    Kernel("pages", ("pages_needed", "page_count", "batches_needed"), """\
def $f($total, $per):
    return ($total + $per - 1) // $per
""", "Return how many groups of `$per` are needed to hold `$total` entries.",
        lambda r: (r.randint(0, 100), r.randint(1, 12)),
        (Bug("off_by_one", "($total + $per - 1)", "($total + $per)"),
         Bug("operator", "($total + $per - 1)", "($total - $per - 1)")),
        edge=((10, 5), (11, 5), (0, 3)),
        roles={"total,per": (("total", "per_page"), ("count", "batch_size"),
                             ("n_items", "capacity"))}),
    Kernel("running", ("running_$P", "cumulative_$P"), """\
def $f($P):
    $acc = 0
    out = []
    for $S in $P:
        $acc += $S
        out.append($acc)
    return out
""", "Return the running totals of the $Ph: element i is the sum of the first i + 1.",
        lambda r: (_ints(r, 0, 30),),
        (Bug("operator", "$acc += $S", "$acc = $S"), Bug("constant", "$acc = 0", "$acc = 1")),
        edge=(([1, 2, 3],),), heldout=True),
    Kernel("spread", ("${S}_range", "spread_of_$P", "${S}_spread"), """\
def $f($P):
    if not $P:
        return 0
    return max($P) - min($P)
""", "Return the difference between the largest and smallest of the $Ph (0 when empty).",
        lambda r: (_ints(r, -10, 50),),
        (Bug("operator", "max($P) - min($P)", "max($P) + min($P)"),
         Bug("condition", "if not $P:", "if len($P) == 1:")),
        edge=(([4, 9, 2],), ([],)), label="spread"),
    Kernel("above_average", ("${P}_above_average", "above_average_$P"), """\
def $f($P):
    if not $P:
        return []
    mean = sum($P) / len($P)
    return [$S for $S in $P if $S > mean]
""", "Return, in order, the $Ph that are strictly above their mean.",
        lambda r: (_ints(r, 0, 40, (1, 7)),),
        (Bug("operator", "if $S > mean]", "if $S < mean]"),
         Bug("off_by_one", "/ len($P)", "/ (len($P) + 1)")),
        edge=(([1, 2, 3, 10],), ([2, 2],))),
    Kernel("unique", ("unique_$P", "dedupe_$P", "distinct_$P"), """\
def $f($P):
    seen = set()
    out = []
    for $S in $P:
        if $S not in seen:
            seen.add($S)
            out.append($S)
    return out
""", "Return the $Ph without repeats, keeping the first occurrence of each, in order.",
        lambda r: (_ints(r, 0, 6, (2, 8)),),
        (Bug("condition", "if $S not in seen:", "if $S in seen:"),),
        edge=(([3, 1, 3, 2, 1],),)),
    Kernel("share", ("share_percent", "percent_of_total", "${S}_share"), """\
def $f($part, $whole):
    if $whole == 0:
        return 0.0
    return round(100 * $part / $whole, 1)
""", "Return `$part` as a percentage of `$whole`, rounded to 1 decimal (0.0 if `$whole` is 0).",
        lambda r: (r.randint(0, 50), r.randint(1, 80)),
        (Bug("constant", "round(100 * ", "round(10 * "),
         Bug("operator", "$part / $whole", "$whole / $part")),
        edge=((1, 4), (0, 0), (3, 12)),
        roles={"part,whole": (("part", "whole"), ("portion", "overall"), ("amount", "total"))}),
    Kernel("word_count", ("count_words", "word_count", "num_words"), """\
def $f($s):
    return len($s.split())
""", "Return the number of whitespace-separated words in `$s`.",
        lambda r: (_words(r).replace(" ", r.choice([" ", "  ", " \t"])),),
        (Bug("constant", "$s.split()", "$s.split(\" \")"),),
        edge=(("two  spaces",), ("",))),
    Kernel("initials", ("initials", "name_initials", "abbreviate"), """\
def $f($s):
    return "".join(part[0].upper() for part in $s.split())
""", "Return the upper-case first letters of the words in `$s`.", lambda r: (_words(r, (1, 4)),),
        (Bug("off_by_one", "part[0]", "part[1]"), Bug("constant", "part[0]", "part[-1]")),
        edge=(("ada lovelace",), ("x ray",))),
    Kernel("slugify", ("slugify", "make_slug", "to_slug"), """\
def $f($s):
    words = $s.lower().split()
    return "-".join(words)
""", "Return `$s` in lower case with its words joined by hyphens.",
        lambda r: (_mixed_case(r),), (Bug("constant", "\"-\".join", "\"_\".join"),),
        edge=(("Hello  World",),)),
    Kernel("longest_word", ("longest_word", "longest_token"), """\
def $f($s):
    $best = ""
    for word in $s.split():
        if len(word) > len($best):
            $best = word
    return $best
""", "Return the longest word in `$s` (the first one on ties; \"\" for no words).",
        lambda r: (_words(r, (2, 5)),),
        (Bug("operator", "if len(word) > len($best):", "if len(word) >= len($best):"),),
        edge=(("cat dog ox",), ("aa bb",))),
    Kernel("truncate", ("truncate", "shorten", "ellipsize"), """\
def $f($s, $n):
    if len($s) <= $n:
        return $s
    return $s[:$n - 3] + "..."
""", "Shorten `$s` to at most `$n` characters; a shortened text ends with \"...\".",
        lambda r: (_words(r, (1, 4)), r.randint(4, 16)),
        (Bug("off_by_one", "$s[:$n - 3]", "$s[:$n - 2]"),
         Bug("operator", "if len($s) <= $n:", "if len($s) < $n:")),
        edge=(("abcdefghij", 10), ("abcdefghij", 7)), heldout=True),
    Kernel("title_case", ("title_case", "capitalize_words"), """\
def $f($s):
    return " ".join(w[:1].upper() + w[1:].lower() for w in $s.split())
""", "Return `$s` with each word capitalized (first letter upper case, the rest lower case).",
        lambda r: (_mixed_case(r),), (Bug("off_by_one", "w[1:].lower()", "w[2:].lower()"),),
        edge=(("hELLO wORLD",),), heldout=True),
    Kernel("fahrenheit", ("to_fahrenheit", "celsius_to_fahrenheit", "c_to_f"), """\
def $f($c):
    return round($c * 9 / 5 + 32, 1)
""", "Convert `$c` degrees Celsius to Fahrenheit, rounded to 1 decimal.",
        lambda r: (r.randint(-30, 45),),
        (Bug("constant", "+ 32, 1)", "+ 23, 1)"), Bug("operator", "$c * 9 / 5", "$c * 5 / 9")),
        edge=((0,), (100,)), roles={"c": ("celsius", "degrees_c", "temp_c")},
        domains=("weather", "scheduling", "astronomy")),
    Kernel("compound", ("compound_balance", "grow_balance", "balance_after"), """\
def $f($amount, $rate, $years):
    for _ in range($years):
        $amount = $amount * (1 + $rate)
    return round($amount, 2)
""", "Return `$amount` after `$years` years of interest at `$rate` (0.05 = 5 %) compounded "
        "yearly, rounded to cents.",
        lambda r: (r.randint(100, 5000), r.choice([0.01, 0.02, 0.05, 0.1]), r.randint(1, 6)),
        (Bug("off_by_one", "range($years)", "range($years - 1)"),
         Bug("operator", "(1 + $rate)", "(1 - $rate)")),
        edge=((1000, 0.1, 2),),
        roles={"amount": ("principal", "balance", "amount"), "rate": ("rate", "interest_rate"),
               "years": ("years", "n_years")}, domains=("banking", "inventory", "shipping")),
    Kernel("discount", ("apply_discount", "discounted_price", "price_after_discount"), """\
def $f($price, $pct):
    return round($price * (1 - $pct / 100), 2)
""", "Return `$price` reduced by `$pct` percent, rounded to 2 decimals.",
        lambda r: (r.randint(1, 500), r.choice([5, 10, 15, 20, 25, 50])),
        (Bug("constant", "$pct / 100", "$pct / 10"), Bug("operator", "(1 - $pct", "(1 + $pct")),
        edge=((200, 25),), roles={"price": ("price", "amount", "cost"),
                                  "pct": ("percent", "discount", "pct_off")},
        domains=("inventory", "recipes", "banking", "shipping", "music")),
    Kernel("perimeter", ("rectangle_perimeter", "perimeter", "fence_length"), """\
def $f($w, $h):
    return 2 * ($w + $h)
""", "Return the perimeter of a `$w` by `$h` rectangle.",
        lambda r: (r.randint(1, 40), r.randint(1, 40)),
        (Bug("operator", "($w + $h)", "($w * $h)"), Bug("constant", "2 * (", "4 * (")),
        edge=((3, 5),), roles={"w,h": (("width", "height"), ("w", "h"), ("length", "breadth"))},
        domains=("geometry", "recipes", "inventory")),
    Kernel("distance", ("distance", "point_distance", "euclidean"), """\
def $f($x1, $y1, $x2, $y2):
    return round(math.hypot($x2 - $x1, $y2 - $y1), 3)
""", "Return the straight-line distance between (`$x1`, `$y1`) and (`$x2`, `$y2`), rounded "
        "to 3 decimals.", lambda r: tuple(r.randint(-10, 10) for _ in range(4)),
        (Bug("operator", "$y2 - $y1", "$y2 + $y1"), Bug("off_by_one", "$x2 - $x1", "$x2 - $x1 - 1")),
        edge=((0, 0, 3, 4),), imports=("math",),
        roles={"x1,y1,x2,y2": (("x1", "y1", "x2", "y2"), ("ax", "ay", "bx", "by"))},
        domains=("geometry", "shipping", "astronomy")),
    Kernel("hours_minutes", ("format_minutes", "as_hours_minutes", "minutes_to_clock"), """\
def $f($m):
    hours, rest = divmod($m, 60)
    return f"{hours}:{rest:02d}"
""", "Format a number of minutes as `H:MM`, e.g. 75 becomes \"1:15\".",
        lambda r: (r.randint(0, 600),),
        (Bug("constant", "divmod($m, 60)", "divmod($m, 100)"),
         Bug("off_by_one", "divmod($m, 60)", "divmod($m - 1, 60)")),
        edge=((75,), (60,)), roles={"m": ("minutes", "total_minutes", "mins")},
        domains=("scheduling", "fitness", "music")),
    Kernel("overlaps", ("overlaps", "slots_overlap", "clashes"), """\
def $f($a0, $a1, $b0, $b1):
    return $a0 < $b1 and $b0 < $a1
""", "Return whether the interval [`$a0`, `$a1`) overlaps [`$b0`, `$b1`) (touching ends do "
        "not overlap).",
        lambda r: (lambda a, b: (a, a + r.randint(1, 5), b, b + r.randint(1, 5)))(
            r.randint(0, 10), r.randint(0, 10)),
        (Bug("operator", "$a0 < $b1 and", "$a0 <= $b1 and"),
         Bug("condition", "$a0 < $b1 and", "$a0 < $b1 or")),
        edge=((1, 3, 3, 5), (3, 5, 1, 3), (1, 2, 5, 6)),
        roles={"a0,a1,b0,b1": (("start_a", "end_a", "start_b", "end_b"),
                               ("a_start", "a_end", "b_start", "b_end"))},
        domains=("scheduling", "music", "fitness"), heldout=True),
    Kernel("letter_grade", ("letter_grade", "grade_for", "to_letter"), """\
def $f($score):
    if $score >= 90:
        return "A"
    if $score >= 80:
        return "B"
    if $score >= 70:
        return "C"
    return "F"
""", "Return \"A\" for 90 and above, \"B\" for 80-89, \"C\" for 70-79, else \"F\".",
        lambda r: (r.choice([r.randint(0, 100), r.choice([70, 79, 80, 89, 90])]),),
        (Bug("operator", ">= 80:", "> 80:"), Bug("constant", ">= 70:", ">= 75:")),
        edge=((80,), (72,), (95,), (10,)), roles={"score": ("score", "points", "mark")},
        domains=("grades", "fitness", "music")),
    Kernel("shipping_cost", ("shipping_cost", "postage", "parcel_price"), """\
def $f($kg):
    if $kg <= 1:
        return 5.0
    return round(5.0 + ($kg - 1) * 2.5, 2)
""", "Return the price of a parcel: 5.0 up to 1 kg, plus 2.5 per kg above that.",
        lambda r: (r.choice([r.randint(1, 20), round(r.uniform(0.2, 12), 1)]),),
        (Bug("constant", "* 2.5, 2)", "* 2.0, 2)"), Bug("off_by_one", "($kg - 1)", "$kg")),
        edge=((3,), (0.5,)), roles={"kg": ("weight", "kilos", "kg")},
        domains=("shipping", "inventory")),
    Kernel("scale", ("scale_recipe", "scale_amounts", "rescale"), """\
def $f($amounts, $old, $new):
    return {name: round(qty * $new / $old, 2) for name, qty in $amounts.items()}
""", "Rescale each amount in `$amounts` (name -> quantity) from `$old` servings to `$new`, "
        "rounded to 2 decimals.",
        lambda r: ({k: r.randint(1, 500) for k in r.sample(
            ["flour", "sugar", "eggs", "milk", "salt", "butter"], r.randint(1, 3))},
            r.randint(1, 6), r.randint(1, 12)),
        (Bug("operator", "qty * $new / $old", "qty * $old / $new"),),
        edge=(({"flour": 200}, 2, 4),),
        roles={"amounts": ("ingredients", "amounts", "quantities"),
               "old,new": (("servings", "target"), ("old_servings", "new_servings"))},
        domains=("recipes", "inventory")),
    Kernel("stdev", ("${S}_stdev", "stdev_of_$P", "${S}_deviation"), """\
def $f($P):
    if len($P) < 2:
        return 0.0
    return round(statistics.stdev($P), 3)
""", "Return the sample standard deviation of the $Ph, rounded to 3 decimals (0.0 for fewer "
        "than two).", lambda r: (_ints(r, 0, 40, (1, 6)),),
        (Bug("off_by_one", "if len($P) < 2:", "if len($P) < 3:"),),
        edge=(([2, 4, 4, 4, 5, 5, 7, 9],), ([1, 3],)), imports=("statistics",)),
    Kernel("as_json", ("${P}_json", "dump_$P", "${P}_as_json"), """\
def $f($P):
    return json.dumps(sorted($P), separators=(",", ":"))
""", "Return the $Ph, sorted, as compact JSON text (no spaces).",
        lambda r: (_ints(r, 0, 40),), (Bug("constant", "separators=(\",\", \":\")",
                                            "separators=(\", \", \":\")"),),
        edge=(([3, 1, 2],),), imports=("json",)),
    Kernel("most_common", ("most_common_$S", "${S}_mode", "commonest_$S"), """\
def $f($P):
    if not $P:
        return None
    return collections.Counter($P).most_common(1)[0][0]
""", "Return the most frequent of the $Ph (the first seen on ties; None when empty).",
        lambda r: (_ints(r, 0, 5, (1, 8)),),
        (Bug("off_by_one", ".most_common(1)[0][0]", ".most_common(2)[-1][0]"),),
        edge=(([1, 2, 2, 3],), ([7, 7, 8],)), imports=("collections",)),
    Kernel("norm", ("${S}_magnitude", "norm_of_$P", "root_sum_squares"), """\
def $f($P):
    return round(math.sqrt(sum(v * v for v in $P)), 3)
""", "Return the square root of the sum of the squared $Ph, rounded to 3 decimals.",
        lambda r: (_ints(r, -10, 10),), (Bug("operator", "v * v", "v + v"),),
        edge=(([3, 4],),), imports=("math",)),
)

BY_KEY = {k.key: k for k in KERNELS}


def kernels_for(split: str, domain: str) -> list[Kernel]:
    """Kernels that fit `domain`; training never draws held-out kernels."""
    return [k for k in KERNELS if (split == "heldout" or not k.heldout)
            and (not k.domains or domain in k.domains)]
