"""Family `fix_import`: a NameError or ImportError in a small package.

Variants: a caller lacks the `from pkg.mod import name` line (NameError when called), imports
from a misspelt module (ModuleNotFoundError), imports a name from the wrong module
(ImportError), or a module uses `math`/`json`/`statistics`/`collections` without importing it
(NameError). Difficulty adds modules and distractors; at 3 the instruction gives only the
failing command and its error. Hidden tests import the modules and call the functions.
"""

from __future__ import annotations

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

VARIANTS = ("missing_import", "wrong_module", "wrong_source", "missing_stdlib")


def _near_miss(ctx: Context, module: str) -> str:
    options = [module + "s", module[:-1] if len(module) > 4 else module + "_", module + "_utils",
               module.replace("_", "")]
    options = [o for o in options if o != module and o not in ctx.taken and o.isidentifier()]
    if not options:
        raise Retry("no near-miss module name")
    return ctx.rng.choice(options)


def build(ctx: Context) -> Draft:
    rng, d, pkg = ctx.rng, ctx.difficulty, ctx.pkg
    variant = rng.choice(VARIANTS)
    home, user = ctx.module(), ctx.module()
    if variant == "missing_stdlib":
        target = ctx.func(where=lambda k: bool(k.imports))
    else:
        target = ctx.func()
    neighbours = [ctx.func(where=lambda k: not k.imports) for _ in range(rng.randint(1, d))]
    funcs = neighbours[:]
    funcs.insert(rng.randint(0, len(funcs)), target)
    cases = ctx.cases(target, 5)
    caller = make_caller(ctx, target)
    extra = [ctx.func(where=lambda k: not k.imports)] if d >= 2 else []
    good_import = f"from {pkg}.{home} import {target.name}"
    home_imports = func_imports(funcs)
    user_imports = [good_import] + func_imports(extra)
    modules = {}
    decoy = None
    if variant == "missing_import":
        bad_import, fix_line = None, good_import
        error = f"NameError: name '{target.name}' is not defined"
        broken, check_call = user, True
    elif variant == "wrong_module":
        wrong = _near_miss(ctx, home)
        bad_import, fix_line = f"from {pkg}.{wrong} import {target.name}", good_import
        error = f"ModuleNotFoundError: No module named '{pkg}.{wrong}'"
        broken, check_call = user, False
    elif variant == "wrong_source":
        decoy = ctx.module()
        decoy_funcs = [ctx.func(where=lambda k: not k.imports) for _ in range(rng.randint(1, 2))]
        modules[decoy] = module_source(module_doc(ctx, decoy), [f.code for f in decoy_funcs])
        bad_import, fix_line = f"from {pkg}.{decoy} import {target.name}", good_import
        error = f"ImportError: cannot import name '{target.name}' from '{pkg}.{decoy}'"
        broken, check_call = user, False
    else:
        lib = target.kernel.imports[0]
        home_imports = [i for i in home_imports if i != f"import {lib}"]
        bad_import, fix_line = None, f"import {lib}"
        error = f"NameError: name '{lib}' is not defined"
        broken, check_call = home, True

    modules[home] = module_source(module_doc(ctx, home), [f.code for f in funcs], home_imports)
    if variant in ("missing_import", "wrong_module", "wrong_source"):
        user_imports = [bad_import] if bad_import else []
        user_imports += func_imports(extra)
    codes = [caller.code()] + [f.code for f in extra]
    modules[user] = module_source(module_doc(ctx, user), codes, user_imports)
    files = package_files(ctx, modules)

    args = cases[0][0]
    if variant == "missing_stdlib":
        command = f'python -c "from {pkg}.{home} import {target.name}; ' \
                  f'print({target.call(args)})"'
    elif check_call:
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

    instruction = phrase(ctx, PHRASES, command=command, error=error, pkg=pkg)
    broken_path = f"{pkg}/{broken}.py"
    if bad_import:
        fix = call("edit_file", path=broken_path, old=bad_import, new=fix_line)
    else:
        fix = add_import_call(files[broken_path], broken_path, fix_line)
    turns = [turn("Let me reproduce the error first.", call("run_command", command=command))]
    to_read = [broken_path]
    if variant != "missing_stdlib":
        turns.append(turn(f"Where is `{target.name}` defined?",
                          call("grep", pattern=f"def {target.name}\\b")))
    turns.append(reads(ctx, to_read))
    why = {"missing_import": f"`{broken_path}` uses `{target.name}` without importing it",
           "wrong_module": f"`{pkg}.{bad_import.split()[1].split('.')[-1]}` does not exist"
           if bad_import else "",
           "wrong_source": f"`{target.name}` is not defined in the module it is imported from",
           "missing_stdlib": f"`{fix_line.split()[-1]}` is used but never imported"}[variant]
    turns.append(turn(f"{why}; the fix is `{fix_line}`.", fix))
    turns.append(turn("Running the command again.", call("run_command", command=command)))
    if rng.random() < 0.2:
        turns.append(tests_check(ctx))
    summary = f"Fixed the import in {broken_path} (`{fix_line}`); `{command}` now works."
    files = finish_repo(ctx, files, list(modules))
    return Draft(instruction, files, hidden_tests, {"turns": turns, "summary": summary},
                 {"kernel": target.kernel.key, "variant": variant})

