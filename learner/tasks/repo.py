"""Building blocks the task families share: rendered functions, modules, tests, phrasings.

`Context` holds one instance's random choices (domain, package, names already taken) and
renders kernels into `Func`s. Expected values come from executing the rendered code
(`outcome`), so hidden tests can never disagree with the reference implementation, and
`differs` proves a planted bug changes the result on at least one tested input. Module and
test sources are plain strings; nothing is written to disk here.
"""

from __future__ import annotations

import copy
import math
import re
import textwrap
from dataclasses import dataclass, field
from random import Random
from string import Template
from typing import Any

from learner.tasks.kernels import ROLES, Kernel, kernels_for
from learner.tasks.vocab import Domain, domains_for, pick

TEST_COMMAND = "python -m pytest -q"
# pytest's summary must say that everything ran and passed: an early exit(0) prints no summary,
# and nothing of a generated task is legitimately skipped, deselected or expected to fail
TEST_EXPECT = r"(?m)^\d+ passed(, \d+ warnings?)? in [\d.]+s"
# The tasks' environment (the agent's commands and grading): no third-party pytest plugins,
# no caches written into the workspace, and pytest's unused built-in plugins off (faster: the
# unraisable- and thread-exception hooks' five garbage collections at exit were ~80 ms of a
# ~450 ms run; 100 oracle episodes 59.6 -> 51.5 s).
TEST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTEST_ADDOPTS": "-p no:cacheprovider -p no:doctest -p no:junitxml "
                              "-p no:pastebin -p no:legacypath -p no:debugging "
                              "-p no:stepwise -p no:faulthandler "
                              "-p no:unraisableexception -p no:threadexception"}


# ---------------------------------------------------------------- phrasing

@dataclass(frozen=True)
class Phrase:
    text: str                                  # str.format template
    heldout: bool = False                      # only the held-out split uses it

    def fields(self) -> set[str]:
        return set(re.findall(r"{(\w+)", self.text))


# Training-only phrasings composed from parts: an opening, one of a family's `TRAIN_PHRASINGS`
# and a closing. The fixed `PHRASES` are a handful of sentences per family, and a small model
# trained on them keys on their wording (it copied the second backticked name of a rename
# whenever the word "rename" was missing) instead of on the names, paths and values they carry:
# on held-out phrasings it then failed whole families. The composed ones vary the words around
# the same fields. Held-out phrasings are never built this way. Off unless asked for
# (`generate(..., phrasings=0.6)`, `SFTConfig.phrasings`): r14, r13's recipe with 60 % composed,
# scored 34 / 100 held-out against r13's 40 (renames 2 / 17 against 8), within what one SFT run
# differs from another, but not a gain.
OPENINGS = ("", "", "", "Hi! ", "Quick one: ", "Task for {pkg}: ", "In {pkg}: ", "Ticket: ",
            "Hello. ", "Working on {pkg} today. ", "Small request. ", "Next item: ")
CLOSINGS = ("", "", "", " Thanks!", " Thank you.", " Keep the change small.",
            " Please check your work.", " Cheers.")


def phrase(ctx: "Context", phrases: list[Phrase], variants: tuple[str, ...] = (),
           **values: Any) -> str:
    """Pick a phrasing of the context's split whose fields are all given, and fill it in;
    `ctx.phrase` records which one (an index past `phrases` for a composed one) and
    `ctx.template` its text.

    In the training split, a share (`ctx.phrasings`) of the instances get a composed one: an
    opening, one of `variants` and a closing, drawn from a generator seeded by the instance's
    values, so `ctx.rng` draws what it drew before and the repository is the same. A variant
    names `{path}` exactly when the fixed phrasing it replaces does (an oracle that finds
    the file when the task does not name it plans the same calls), and phrasings that hand the
    agent a failing test (`{failing}`) are kept."""
    heldout = ctx.split == "heldout"
    pool = [i for i, p in enumerate(phrases) if p.heldout == heldout and p.fields() <= set(values)]
    if not pool:
        raise ValueError(f"no {ctx.split} phrasing for fields {sorted(values)}")
    index = ctx.rng.choice(pool)
    ctx.phrase, ctx.template = (index, phrases[index].heldout), phrases[index].text
    if not heldout and variants and ctx.phrasings and "{failing}" not in ctx.template:
        side = Random(f"{ctx.template}|{sorted(values.items())}")
        named = "{path}" in ctx.template
        fits = [i for i, v in enumerate(variants) if ("{path}" in v) == named
                and Phrase(v).fields() <= set(values)]
        if fits and side.random() < ctx.phrasings:
            i = side.choice(fits)
            ctx.phrase = (len(phrases) + i, False)
            ctx.template = side.choice(OPENINGS) + variants[i] + side.choice(CLOSINGS)
    return ctx.template.format(**values)


# ---------------------------------------------------------------- functions

@dataclass
class Func:
    kernel: Kernel
    name: str
    names: dict[str, str]                      # placeholder -> identifier
    code: str                                  # def line, docstring, body
    doc: str
    raw: str = ""                              # def line and body, no docstring
    module: str = ""                           # set when placed: "pkg.mod"

    def body(self, code: str | None = None) -> str:
        """The code without its docstring (for exec)."""
        imports = "".join(f"import {m}\n" for m in self.kernel.imports)
        return imports + (code or self.code)

    def sub(self, template: str) -> str:
        return Template(template).substitute(self.names)

    def call(self, args: tuple) -> str:
        return f"{self.name}({', '.join(_lit(a) for a in args)})"


def _lit(value: Any) -> str:
    return repr(value)


def _docstring(doc: str, examples: list[str] | None = None) -> str:
    lines = textwrap.wrap(doc, 84)
    if examples:
        lines += [""] + examples
    if len(lines) == 1:
        return f'    """{lines[0]}"""\n'
    body = "".join(f"    {line}\n" if line else "\n" for line in lines)
    return f'    """{body[4:]}    """\n'


def with_docstring(code: str, doc: str, examples: list[str] | None = None) -> str:
    head, rest = code.split("\n", 1)
    return f"{head}\n{_docstring(doc, examples)}{rest}"


# ---------------------------------------------------------------- running code

_NAMESPACES: dict[str, dict] = {}


def outcome(code: str, name: str, args: tuple) -> tuple[str, Any]:
    """("ok", value) or ("raise", exception name) of calling `name(*args)` as `code` defines it."""
    ns = _NAMESPACES.get(code)
    if ns is None:
        ns = {}
        exec(compile(code, f"<{name}>", "exec"), ns)  # our own generated code only
        if len(_NAMESPACES) > 4096:
            _NAMESPACES.clear()
        _NAMESPACES[code] = ns
    try:
        return "ok", ns[name](*copy.deepcopy(args))
    except Exception as exc:
        return "raise", type(exc).__name__


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and \
            math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def differs(good: tuple[str, Any], bad: tuple[str, Any]) -> bool:
    return good[0] != bad[0] or not same(good[1], bad[1])


def describe(result: tuple[str, Any]) -> str:
    """How an instruction shows a result: `7`, `'a-b'`, or `a ZeroDivisionError`."""
    kind, value = result
    if kind == "raise":
        article = "an" if value[0] in "AEIOU" else "a"
        return f"{article} {value}"
    return f"`{value!r}`"


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, (list, tuple)):
        return any(map(_has_float, value))
    if isinstance(value, dict):
        return any(map(_has_float, value.values()))
    return False


def assert_line(call: str, result: tuple[str, Any], indent: str = "    ") -> str:
    kind, value = result
    if kind == "raise":
        return f"{indent}with pytest.raises({value}):\n{indent}    {call}\n"
    expected = f"pytest.approx({value!r})" if _has_float(value) else repr(value)
    return f"{indent}assert {call} == {expected}\n"


# ---------------------------------------------------------------- one instance's choices

@dataclass
class Context:
    rng: Random
    split: str
    difficulty: int
    domain: Domain = None
    pkg: str = ""
    taken: set[str] = field(default_factory=set)       # identifiers and module names in use
    used_kernels: set[str] = field(default_factory=set)
    phrase: tuple[int, bool] | None = None              # (index, heldout) of the phrasing used
    template: str = ""                                  # and its text, before filling in
    phrasings: float = 0.0                              # share of composed phrasings (training)

    def __post_init__(self):
        if self.domain is None:
            self.domain = self.rng.choice(domains_for(self.split))
        if not self.pkg:
            self.pkg = self.rng.choice(self.domain.packages)
        self.taken.update({self.pkg, "cli", "tests", "main"})

    def module(self) -> str:
        name = pick(self.rng, self.domain.modules, self.taken)
        if name in self.taken:
            name = f"{name}_{len(self.taken)}"
        self.taken.add(name)
        return name

    def kernel(self, where=None) -> Kernel:
        pool = [k for k in kernels_for(self.split, self.domain.key)
                if k.key not in self.used_kernels and (where is None or where(k))]
        kernel = self.rng.choice(pool)
        self.used_kernels.add(kernel.key)
        return kernel

    def func(self, kernel: Kernel | None = None, where=None, name: str | None = None) -> Func:
        """Render a kernel with this domain's names, avoiding names already taken."""
        kernel = kernel or self.kernel(where)
        self.used_kernels.add(kernel.key)
        used = set(re.findall(r"\$\{?(\w+)", kernel.code)) - {"f"}
        for _ in range(50):
            q = self.rng.choice(self.domain.quantities)
            names = {"P": q.plural, "S": q.singular, "Ph": q.human,
                     "s": self.rng.choice(self.domain.texts)}
            for key, choices in {**ROLES, **kernel.roles}.items():
                value = self.rng.choice(choices)
                names.update(zip(key.split(","), value) if "," in key else [(key, value)])
            fname = name or Template(self.rng.choice(kernel.names)).substitute(names)
            values = [names[u] for u in used]
            if fname in self.taken or fname in values or len(set(values)) != len(values):
                continue
            names["f"] = fname
            doc = Template(kernel.doc).substitute(names)
            raw = Template(kernel.code).substitute(names)
            self.taken.add(fname)
            return Func(kernel, fname, names, with_docstring(raw, doc), doc, raw=raw)
        raise RuntimeError(f"could not name kernel {kernel.key} in {self.domain.key}")

    def cases(self, func: Func, n: int, code: str | None = None) -> list[tuple[tuple, Any]]:
        """`n` random argument tuples plus the kernel's edge cases, with their outcomes."""
        seen, out = set(), []
        args_list = list(func.kernel.edge) + [func.kernel.gen(self.rng) for _ in range(3 * n)]
        for args in args_list:
            key = repr(args)
            if key in seen:
                continue
            seen.add(key)
            result = outcome(func.body(code), func.name, args)
            if result[0] == "ok":
                out.append((args, result))
            if len(out) >= n + len(func.kernel.edge):
                break
        return out


# ---------------------------------------------------------------- sources

def module_source(doc: str, funcs: list[str], imports: list[str] = ()) -> str:
    """A module: docstring, imports, then the functions two blank lines apart."""
    head = f'"""{doc}"""\n'
    if imports:
        head += "\n" + "".join(line + "\n" for line in sorted(set(imports), key=_import_key))
    return head + "".join("\n\n" + code for code in funcs)


def _import_key(line: str) -> tuple:
    return (line.startswith("from "), line)


def func_imports(funcs: list[Func]) -> list[str]:
    return [f"import {m}" for f in funcs for m in f.kernel.imports]


def test_source(imports: dict[str, list[str]], tests: list[tuple[str, str]],
                extra_imports: list[str] = ()) -> str:
    """A pytest module: `imports` maps modules to names; `tests` are (name, body) pairs."""
    body = "".join(f"\n\ndef {name}():\n{code}" for name, code in tests)
    needs = {"import pytest"} if "pytest." in body else set()
    lines = sorted(needs | set(extra_imports), key=_import_key)
    lines += [f"from {mod} import {', '.join(sorted(set(names)))}"
              for mod, names in sorted(imports.items()) if names]
    return "\n".join(lines) + "\n" + body


def case_tests(func: Func, cases: list[tuple[tuple, Any]], prefix: str = "test") -> \
        list[tuple[str, str]]:
    """Split `cases` into one or two test functions for `func`."""
    half = max(1, (len(cases) + 1) // 2)
    chunks = [cases[:half], cases[half:]] if len(cases) > 3 else [cases]
    suffixes = ["", "_more"]
    return [(f"{prefix}_{func.name}{suffixes[i]}",
             "".join(assert_line(func.call(args), result) for args, result in chunk))
            for i, chunk in enumerate(chunks) if chunk]


def readme(ctx: Context, modules: list[str], extra: str = "") -> str:
    title = ctx.pkg.replace("_", " ").title()
    lines = [f"# {title}", "", f"Small helpers for {ctx.domain.blurb}.", "", "Modules:", ""]
    lines += [f"- `{ctx.pkg}/{m}.py`" for m in modules]
    lines += ["", "Run the tests with `python -m pytest -q`."]
    if extra:
        lines += ["", extra]
    return "\n".join(lines) + "\n"


def config_files(ctx: Context) -> dict[str, str]:
    """Sometimes a pytest configuration, as real repositories have."""
    choice = ctx.rng.random()
    if choice < 0.3:
        return {"pyproject.toml": f'[project]\nname = "{ctx.pkg}"\nversion = "0.1.0"\n\n'
                                  '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n'}
    if choice < 0.45:
        return {"pytest.ini": "[pytest]\ntestpaths = tests\n"}
    return {}


def package_files(ctx: Context, modules: dict[str, str], exports: dict[str, list[str]] = None) \
        -> dict[str, str]:
    """`pkg/__init__.py` (optionally re-exporting names) and `pkg/<module>.py` files."""
    init = f'"""{ctx.pkg}: small helpers for {ctx.domain.blurb}."""\n'
    if exports:
        init += "\n" + "".join(f"from {ctx.pkg}.{m} import {', '.join(names)}\n"
                               for m, names in sorted(exports.items()))
    files = {f"{ctx.pkg}/__init__.py": init}
    files.update({f"{ctx.pkg}/{m}.py": src for m, src in modules.items()})
    return files


def module_doc(ctx: Context, module: str) -> str:
    noun = module.replace("_", " ")
    return ctx.rng.choice([f"Helpers for {noun}.", f"{noun.capitalize()}: small, pure functions.",
                           f"Functions used by the {noun} reports.",
                           f"{noun.capitalize()} utilities for {ctx.domain.blurb}."])


def unique_snippet(text: str, start: int, end: int) -> str:
    """The lines around text[start:end], grown until they occur exactly once in `text`."""
    lines = text.splitlines(keepends=True)
    offsets, pos = [], 0
    for line in lines:
        offsets.append(pos)
        pos += len(line)
    first = max(i for i, o in enumerate(offsets) if o <= start)
    last = max(i for i, o in enumerate(offsets) if o < max(end, start + 1))
    while True:
        snippet = "".join(lines[first:last + 1])
        if text.count(snippet) == 1 or (first == 0 and last == len(lines) - 1):
            return snippet
        if first > 0:
            first -= 1
        if text.count("".join(lines[first:last + 1])) > 1 and last < len(lines) - 1:
            last += 1


def add_import_call(text: str, path: str, line: str) -> dict:
    """An edit_file call adding the import `line` to a module made by `module_source`."""
    doc_end = text.index('"""\n', 3) + 4
    rest = text[doc_end:]
    if rest.startswith(("\nimport ", "\nfrom ")):
        block = rest[1:].split("\n\n", 1)[0]
        lines = block.split("\n") + [line]
        return call("edit_file", path=path, old=block,
                    new="\n".join(sorted(lines, key=_import_key)))
    docline = text[:doc_end].rstrip("\n")
    return call("edit_file", path=path, old=docline, new=docline + "\n\n" + line)


def edit_call(text: str, old: str, new: str, path: str, within: str = "") -> dict:
    """An edit_file call replacing `old` (its first occurrence inside `within`, a unique part
    of `text`) by `new`, with enough surrounding lines to match one place only."""
    start = text.index(within) + within.index(old) if within else text.index(old)
    snippet = unique_snippet(text, start, start + len(old))
    cut = start - text.index(snippet)
    fixed = snippet[:cut] + new + snippet[cut + len(old):]
    if snippet.endswith("\n") and fixed.endswith("\n") and text.count(snippet.rstrip("\n")) == 1:
        snippet, fixed = snippet.rstrip("\n"), fixed.rstrip("\n")
    return call("edit_file", path=path, old=snippet, new=fixed)


# ---------------------------------------------------------------- drafts and oracle plans

class Retry(Exception):
    """This draw cannot make a good instance (e.g. no input tells the bug apart); draw again."""


@dataclass
class Draft:
    """What a family builds; `learner.tasks.generate` turns it into a `TaskInstance`."""
    instruction: str
    files: dict[str, str]
    hidden_tests: dict[str, str]
    solution: dict                             # {"turns": [{"say", "calls"}...], "summary"}
    meta: dict = field(default_factory=dict)


def call(name: str, **arguments: Any) -> dict:
    return {"name": name, "arguments": arguments}


def turn(say: str, *calls: dict) -> dict:
    return {"say": say, "calls": list(calls)}


def reads(ctx: Context, paths: list[str]) -> dict:
    say = ctx.rng.choice(["Let me read the relevant code.", "I'll look at the code first.",
                          "Reading the files involved.", "First, the source."])
    return turn(say, *[call("read_file", path=p) for p in paths])


def python_check(ctx: Context, module: str, names: list[str], expr: str) -> dict:
    """A turn that runs `python -c` printing `expr` (or the tests when quoting gets hard)."""
    snippet = f"from {module} import {', '.join(names)}; print(repr({expr}))"
    if any(ch in snippet for ch in '"$`\\!'):
        return tests_check(ctx)
    say = ctx.rng.choice(["Checking the result now.", "Let me verify the fix.",
                          "Quick check that it behaves as expected."])
    return turn(say, call("run_command", command=f'python -c "{snippet}"'))


def tests_check(ctx: Context, target: str = "") -> dict:
    say = ctx.rng.choice(["Running the tests.", "Now the test suite.", "Let me run the tests."])
    return turn(say, call("run_command", command=("python -m pytest -q " + target).strip()))


def hidden_path(name: str) -> str:
    """Where a family's hidden tests go: a name no honest agent would write or read."""
    return f"tests/test_acceptance_{name}.py"


def finish_repo(ctx: Context, files: dict[str, str], modules: list[str]) -> dict[str, str]:
    """Add the README and, sometimes, a pytest configuration."""
    files = dict(files)
    files["README.md"] = readme(ctx, modules)
    files.update(config_files(ctx))
    return dict(sorted(files.items()))


# ---------------------------------------------------------------- callers

CALLER_NAMES = ("summary_line", "format_report", "report_line", "headline", "status_line",
                "render_row", "describe_result", "log_line")


@dataclass
class Caller:
    """A function in another module that calls `target` and formats its result."""
    name: str
    target: Func
    params: str                                # "xs, limit"
    label: str

    def code(self, target_name: str | None = None, target_ref: str | None = None) -> str:
        ref = target_ref or target_name or self.target.name
        return (f"def {self.name}({self.params}):\n"
                f'    """One line of the report: the {self.label}."""\n'
                f"    value = {ref}({self.params})\n"
                f'    return f"{self.label}: {{value}}"\n')

    def outcome(self, args: tuple, target_code: str | None = None) -> tuple[str, Any]:
        source = self.target.body(target_code) + "\n" + self.code()
        return outcome(source, self.name, args)

    def call(self, args: tuple) -> str:
        return f"{self.name}({', '.join(_lit(a) for a in args)})"


def make_caller(ctx: Context, target: Func) -> Caller:
    name = pick(ctx.rng, CALLER_NAMES, ctx.taken)
    if name in ctx.taken:
        name = f"{name}_{len(ctx.taken)}"
    ctx.taken.add(name)
    params = re.match(r"def \w+\((.*)\):", target.code).group(1)
    return Caller(name, target, params, target.name.replace("_", " "))
