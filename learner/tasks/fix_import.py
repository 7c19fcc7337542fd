"""Family `fix_import`: a NameError or ImportError in a small package.

Variants: a caller lacks the `from pkg.mod import name` line (NameError when called), imports
from a misspelt module (ModuleNotFoundError), imports a name from the wrong module
(ImportError), or a module uses `math`/`json`/`statistics`/`collections` without importing it
(NameError). Difficulty adds modules and distractors; at 3 the instruction gives only the
failing command and its error. Hidden tests import the modules and call the functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from learner.tasks.repo import (Context, Draft, Phrase, Retry, add_import_call, call,
                                case_tests, finish_repo,
                                func_imports, hidden_path, make_caller, module_doc,
                                module_source, package_files, phrase, reads, test_source,
                                tests_check, turn)

NAME = "fix_import"

PHRASES = [
    Phrase("Running `{command}` fails with `{error}`. Fix the code so that it works."),
    Phrase("`{command}` crashes: `{error}`. Please fix the problem in the {pkg} package."),
    Phrase("Fix this error in {pkg}:\n\n    $ {command}\n    {error}\n"),
    Phrase("I get `{error}` when I run `{command}`. Can you repair the imports?"),
    Phrase("`{error}` — that's what `{command}` prints. Make the command succeed."),
    Phrase("CI fails with `{error}` when it runs `{command}`. Make the command pass.",
           heldout=True),
    Phrase("After a refactor, {pkg} raises `{error}`. Reproduce it with `{command}` and fix "
           "the cause.", heldout=True),
]

# Training-only phrasings (`repo.phrase` composes them with an opening and a closing)
TRAIN_PHRASINGS = (
    "`{command}` stops with `{error}`. Fix it.",
    "Please fix {pkg}: `{command}` raises `{error}`.",
    "I ran `{command}` and got `{error}`. Make it run.",
    "Something is broken: `{command}` fails with `{error}`.",
    "`{command}` no longer works (`{error}`). Repair the code.",
    "Error when running `{command}`: `{error}`. Please fix the package.",
)

VARIANTS = ("missing_import", "wrong_module", "wrong_source", "missing_stdlib")


def _near_miss(ctx: Context, module: str) -> str:
    options = [module + "s", module[:-1] if len(module) > 4 else module + "_", module + "_utils",
               module.replace("_", "")]
    options = [o for o in options if o != module and o not in ctx.taken and o.isidentifier()]
    if not options:
        raise Retry("no near-miss module name")
    return ctx.rng.choice(options)


@dataclass
class Breakage:
    bad_import: str | None                     # the wrong import line, or None when missing
    fix_line: str                              # the import line that fixes it
    error: str                                 # the last line of the traceback
    broken: str                                # the module to fix
    why: str                                   # the oracle's diagnosis


def _break(ctx: Context, variant: str, home: str, user: str, target, modules: dict) -> Breakage:
    """Decide how the import breaks; `wrong_source` adds its decoy module to `modules`."""
    pkg, name = ctx.pkg, target.name
    # the fix imports relative to the package (both modules are in it): its module is the
    # file name the search printed, one short copy; `pkg.home` from `pkg/home.py` was a
    # conversion a small model gets wrong (it wrote `from pkg import name`)
    good = f"from .{home} import {name}"
    if variant == "missing_import":
        return Breakage(None, good, f"NameError: name '{name}' is not defined", user,
                        f"`{pkg}/{user}.py` uses `{name}` without importing it")
    if variant == "wrong_module":
        wrong = _near_miss(ctx, home)
        return Breakage(f"from {pkg}.{wrong} import {name}", good,
                        f"ModuleNotFoundError: No module named '{pkg}.{wrong}'", user,
                        f"there is no module `{pkg}.{wrong}`")
    if variant == "wrong_source":
        decoy = ctx.module()
        decoy_funcs = [ctx.func(where=lambda k: not k.imports)
                       for _ in range(ctx.rng.randint(1, 2))]
        modules[decoy] = module_source(module_doc(ctx, decoy), [f.code for f in decoy_funcs])
        return Breakage(f"from {pkg}.{decoy} import {name}", good,
                        f"ImportError: cannot import name '{name}' from '{pkg}.{decoy}'", user,
                        f"`{name}` is not defined in `{pkg}.{decoy}`")
    lib = target.kernel.imports[0]
    return Breakage(None, f"import {lib}", f"NameError: name '{lib}' is not defined", home,
                    f"`{lib}` is used but never imported")


def build(ctx: Context) -> Draft:
    rng, d, pkg = ctx.rng, ctx.difficulty, ctx.pkg
    variant = rng.choice(VARIANTS)
    home, user = ctx.module(), ctx.module()
    target = ctx.func(where=lambda k: bool(k.imports)) if variant == "missing_stdlib" \
        else ctx.func()
    neighbours = [ctx.func(where=lambda k: not k.imports) for _ in range(rng.randint(1, d))]
    funcs = neighbours[:]
    funcs.insert(rng.randint(0, len(funcs)), target)
    cases = ctx.cases(target, 5)
    caller = make_caller(ctx, target)
    extra = [ctx.func(where=lambda k: not k.imports)] if d >= 2 else []
    modules = {}
    brk = _break(ctx, variant, home, user, target, modules)
    home_imports = [i for i in func_imports(funcs) if i != brk.fix_line]
    modules[home] = module_source(module_doc(ctx, home), [f.code for f in funcs], home_imports)
    user_imports = [f"from {pkg}.{home} import {target.name}"] if variant == "missing_stdlib" \
        else [brk.bad_import] if brk.bad_import else []
    modules[user] = module_source(module_doc(ctx, user), [caller.code()] + [f.code for f in extra],
                                  user_imports + func_imports(extra))
    files = package_files(ctx, modules)

    args = cases[0][0]
    if variant == "missing_stdlib":
        command = f'python -c "from {pkg}.{home} import {target.name}; print({target.call(args)})"'
    elif brk.bad_import is None:
        command = f'python -c "from {pkg}.{user} import {caller.name}; print({caller.call(args)})"'
    else:
        command = f'python -c "import {pkg}.{user}"'
    if any(ch in command[11:-1] for ch in '"$`\\!'):
        raise Retry("command needs awkward quoting")

    files[f"tests/test_{home}.py"] = test_source(
        {f"{pkg}.{home}": [f.name for f in neighbours]},
        [t for f in neighbours for t in case_tests(f, ctx.cases(f, 2))])
    hidden = case_tests(target, cases, prefix="test_import")
    hidden.append((f"test_{caller.name}_runs", "".join(
        f"    assert {caller.call(a)} == {caller.outcome(a)[1]!r}\n" for a, _ in cases)))
    hidden_tests = {hidden_path(caller.name): test_source(
        {f"{pkg}.{home}": [target.name], f"{pkg}.{user}": [caller.name]}, hidden)}

    instruction = phrase(ctx, PHRASES, TRAIN_PHRASINGS, command=command, error=brk.error,
                         pkg=pkg)
    turns = _plan(ctx, brk, files, command, target.name,
                  f"{pkg}.{home}" if variant != "missing_stdlib" else None)
    summary = f"Fixed the import in {pkg}/{brk.broken}.py (`{brk.fix_line}`); `{command}` works."
    files = finish_repo(ctx, files, list(modules))
    return Draft(instruction, files, hidden_tests, {"turns": turns, "summary": summary},
                 {"kernel": target.kernel.key, "variant": variant})


def _plan(ctx: Context, brk: Breakage, files: dict, command: str, name: str,
          home: str | None) -> list[dict]:
    """Reproduce, (find the definition of `name` in module `home`,) read, fix the import,
    rerun (, run the tests).

    The sentences carry each fact the fix needs next to where it is used, so the copies a
    small model makes are short: the turn after the search names the file it found, and the
    fix's sentence names that file last, right before the relative import line whose module
    is its file name (not the misspelt module, which the error and the diagnosis mention)."""
    path = f"{ctx.pkg}/{brk.broken}.py"
    fix = call("edit_file", path=path, old=brk.bad_import, new=brk.fix_line) if brk.bad_import \
        else add_import_call(files[path], path, brk.fix_line)
    turns = [turn("Let me reproduce the error first.", call("run_command", command=command))]
    read, say = reads(ctx, [path]), f"{brk.why}; the fix is `{brk.fix_line}`."
    if home:
        turns.append(turn(f"Where is `{name}` defined?", call("grep", pattern=f"def {name}\\b")))
        found = f"{home.replace('.', '/')}.py"
        read["say"] = f"It is defined in `{found}`. {read['say']}"
        say = f"{brk.why}. `{name}` is in `{found}`, so the fix is `{brk.fix_line}`."
    turns += [read, turn(say, fix),
              turn("Running the command again.", call("run_command", command=command))]
    if ctx.rng.random() < 0.2:
        turns.append(tests_check(ctx))
    return turns
