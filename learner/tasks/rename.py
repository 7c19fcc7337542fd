"""Family `rename_symbol`: rename a function across the package (definition, imports, calls).

Difficulty 1: defined in one module, used by one caller in another. 2: also re-exported from
the package's `__init__.py`. 3: used from two more modules, one of them through a module
import (`mod.name(...)`). Hidden tests import the new name, check the callers still work and
that the old name is gone from every source file of the package.
"""

from __future__ import annotations

import re
from dataclasses import replace

from learner.tasks.repo import (Context, Draft, Phrase, Retry, call, case_tests, finish_repo,
                                func_imports, hidden_path, make_caller, module_doc,
                                module_source, package_files, phrase, test_source,
                                tests_check, turn)

NAME = "rename_symbol"

PHRASES = [
    Phrase("Rename the function `{old}` to `{new}` throughout the {pkg} package: the definition "
           "and every place that uses it."),
    Phrase("Please rename `{old}` (defined in `{path}`) to `{new}` and update all callers and "
           "imports. Don't leave an alias with the old name."),
    Phrase("`{old}` is a confusing name. Change it to `{new}` everywhere in the code."),
    Phrase("Refactor: `{old}` -> `{new}`. Update every reference in the package so nothing uses "
           "the old name any more."),
    Phrase("We're renaming `{old}` to `{new}`. Make the change across all modules of {pkg}; the "
           "tests must keep passing."),
    Phrase("We are standardising names in {pkg}. `{old}` must become `{new}`; every import and "
           "call site has to follow, and the old name should disappear.", heldout=True),
    Phrase("Do a project-wide rename of `{old}` to `{new}` (see `{path}`). No trace of the old "
           "name should remain.", heldout=True),
]

# Training-only phrasings (`repo.phrase` composes them with an opening and a closing)
TRAIN_PHRASINGS = (
    "`{old}` should be called `{new}` from now on. Update the definition, the imports and the "
    "calls.",
    "Change the name of `{old}` to `{new}` in every module that mentions it.",
    "Give `{old}` a new name, `{new}`, and fix every reference to it.",
    "The function `{old}` in `{path}` needs the name `{new}`; its callers and imports too.",
    "Replace the name `{old}` with `{new}` across {pkg}: the definition and all its uses.",
    "Rename request: old name `{old}`, new name `{new}`.",
    "Switch every use of `{old}` over to `{new}`, and rename the function itself.",
    "`{old}` to `{new}`, please, everywhere in the package.",
    "Let's call `{old}` `{new}` instead. Every caller has to use the new name.",
    "I'd like `{old}` renamed to `{new}`; keep the tests green.",
    "Use `{new}` as the name of `{old}` (in `{path}`) and update all references.",
    "The name `{new}` should replace `{old}` everywhere in {pkg}.",
    "Nothing in {pkg} should be called `{old}` any more; call it `{new}`.",
    "Could you rename `{old}`, defined in `{path}`, to `{new}`? Update its callers.",
)

NEW_PREFIXES = ("compute_", "calc_", "get_", "find_")


def _new_name(ctx: Context, func) -> str:
    options = [ctx.rng.choice(NEW_PREFIXES) + func.name, func.name + "_value"]
    options += [func.sub(t) for t in func.kernel.names]
    options = [o for o in options if o != func.name and o not in ctx.taken
               and func.name not in o and o not in func.name]
    if not options:
        raise Retry("no fresh name")
    name = ctx.rng.choice(options)
    ctx.taken.add(name)
    return name


def rename_command(old: str, new: str) -> str:
    """The shell command renaming the identifier `old` to `new` in every Python file under the
    workspace that uses it (whole words only). GNU sed's word boundaries are `\\<` and `\\>`,
    not `\\b`: the letter `b` would join the name's first letters into another token
    (`bc`, `ount` for `count...`), and a model that copies names token by token drops them."""
    return f"sed -i 's/\\<{old}\\>/{new}/g' $(grep -rlw --include='*.py' {old} .)"


# `rename_command`'s own text with its names as groups (the first OLD names it, the second
# must repeat it)
RENAME_RE = re.compile(re.escape(rename_command("OLD", "NEW")).replace("OLD", r"(?P<old>\w+)", 1)
                       .replace("NEW", r"(?P<new>\w+)").replace("OLD", "(?P=old)"))


def apply_rename(command: str, files: dict[str, str]) -> dict[str, str] | None:
    """What `rename_command` does to `files` (path -> text), or None for another command."""
    m = RENAME_RE.fullmatch(command)
    if not m:
        return None
    word = re.compile(rf"\b{m['old']}\b")
    return {p: word.sub(m["new"], t) if p.endswith(".py") else t for p, t in files.items()}


def build(ctx: Context) -> Draft:
    rng, d, pkg = ctx.rng, ctx.difficulty, ctx.pkg
    target = ctx.func()
    old, new = target.name, _new_name(ctx, target)
    if "_" not in old:
        raise Retry("a one-word name also appears in the callers' labels")
    home = ctx.module()
    path = f"{pkg}/{home}.py"
    neighbours = [ctx.func() for _ in range(rng.randint(1, d))]
    funcs = neighbours[:]
    funcs.insert(rng.randint(0, len(funcs)), target)
    modules = {home: module_source(module_doc(ctx, home), [f.code for f in funcs],
                                   func_imports(funcs))}
    cases = ctx.cases(target, 5)
    users = []                                  # (module, caller)
    for i in range(1 if d < 3 else 3):
        mod, caller = ctx.module(), make_caller(ctx, target)
        as_module = d == 3 and i == 2
        if as_module and home in re.findall(r"\w+", caller.params):
            raise Retry("a parameter would shadow the module (`readings.f(readings)`)")
        ref = f"{home}.{old}" if as_module else None
        imports = [f"from {pkg} import {home}" if as_module else f"from {pkg}.{home} import {old}"]
        extra = [ctx.func()] if rng.random() < 0.5 else []
        codes = [caller.code(target_ref=ref)] + [f.code for f in extra]
        modules[mod] = module_source(module_doc(ctx, mod), codes, imports + func_imports(extra))
        users.append((mod, caller))
    exports = {home: [old]} if d >= 2 else None
    files = package_files(ctx, modules, exports)
    for text in files.values():
        words = set(re.findall(r"\w+", text))
        if any(w != old and old in w for w in words) or new in words:
            raise Retry("old name is part of another identifier")

    test_imports = {f"{pkg}.{m}": [c.name] for m, c in users}
    test_imports[f"{pkg}.{home}"] = [f.name for f in neighbours]
    visible = [t for f in neighbours for t in case_tests(f, ctx.cases(f, 2))]
    for m, c in users:
        args, _ = cases[0]
        visible.append((f"test_{c.name}", f"    assert {c.call(args)} == {c.outcome(args)[1]!r}\n"))
    files[f"tests/test_{home}.py"] = test_source(test_imports, visible)

    hidden = case_tests(replace(target, name=new), cases, prefix="test_renamed")
    for i, (m, c) in enumerate(users):
        hidden.append((f"test_caller_{i}_still_works", "".join(
            f"    assert {c.call(args)} == {c.outcome(args)[1]!r}\n" for args, _ in cases)))
    hidden.append(("test_old_name_is_gone", (
        f"    assert not hasattr({home}_module, {old!r})\n"
        f"    root = pathlib.Path({home}_module.__file__).resolve().parent\n"
        f"    for source in sorted(root.rglob('*.py')):\n"
        f"        assert re.search(r'\\b{old}\\b', source.read_text()) is None, source\n")))
    hidden_imports = {f"{pkg}.{home}": [new], **{f"{pkg}.{m}": [c.name] for m, c in users}}
    hidden_src = test_source(hidden_imports, hidden, ["import pathlib", "import re",
                                                      f"import {pkg}.{home} as {home}_module"])
    hidden_tests = {hidden_path(new): hidden_src}

    instruction = phrase(ctx, PHRASES, TRAIN_PHRASINGS, old=old, new=new, pkg=pkg, path=path)
    touched = sorted(p for p, text in files.items() if re.search(rf"\b{old}\b", text)
                     and not p.startswith("tests/"))
    # the rename is one substitution over the files the search lists, as a developer does it
    # in a shell: the call copies the two names (said again just before it, as the task said
    # them) and no list of files, which a small model loses its place in (the shipped model
    # edited one file three times and missed two)
    turns = [turn(rng.choice(["First, every place the name appears.", "Let me find all uses.",
                              "Searching for the old name."]),
                  call("grep", pattern=old)),        # no \b: see fix_bug.py
             turn(rng.choice(["Renaming `{0}` to `{1}` in every file that uses it.",
                              "Now the rename of `{0}` to `{1}`, in all those files at once.",
                              "Applying the rename of `{0}` to `{1}` everywhere it appears."]
                             ).format(old, new),
                  call("run_command", command=rename_command(old, new)))]
    # the check is the test suite: a `python -c` call of a caller needs its name and arguments,
    # which nothing before it has read (r10 wrote the rename's `sed` exactly and then a check
    # of a made-up caller, which failed, and edited working files until its steps ran out).
    # The draw that chose between the two stays, so every instance is as it was.
    rng.random()
    turns.append(tests_check(ctx))
    summary = f"Renamed `{old}` to `{new}` in {', '.join(touched)}; the tests pass."
    files = finish_repo(ctx, files, list(modules))
    return Draft(instruction, files, hidden_tests, {"turns": turns, "summary": summary},
                 {"kernel": target.kernel.key, "old": old, "new": new})
