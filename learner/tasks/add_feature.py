"""Family `add_feature`: add a documented function to a module, together with its test.

The instruction gives the signature, the behaviour and usually an example. Difficulty 1 names
the test file to write; 2 only asks for a test; 3 also asks to export the function from the
package. Hidden tests check the behaviour (edge cases included), that some test file other
than the hidden one exercises the new function, and at 3 that `from pkg import name` works.
"""

from __future__ import annotations

import re

from learner.tasks.repo import (Context, Draft, Phrase, assert_line, call, case_tests,
                                finish_repo, func_imports, hidden_path, module_doc,
                                module_source, package_files, phrase, reads, test_source,
                                tests_check, turn, add_import_call)

NAME = "add_feature"

PHRASES = [
    Phrase("Add a function `{sig}` to `{path}`. {doc} {example}Also add a test for it{where}."),
    Phrase("New feature for {pkg}: `{sig}` in `{path}`. {doc} {example}Please include a "
           "test{where}."),
    Phrase("Please write a new helper `{sig}` in `{path}` and cover it with a test{where}. "
           "What it does: {doc} {example}"),
    Phrase("Extend `{path}` with `{sig}`. Behaviour: {doc} {example}Add a unit test for "
           "it{where}."),
    Phrase("Feature request: {pkg} needs `{sig}` (put it in `{path}`). Spec: {doc} {example}"
           "Ship it with a test{where}.", heldout=True),
    Phrase("Could you add `{sig}` to the {pkg} package, in `{path}`? {doc} {example}It needs a "
           "test as well{where}.", heldout=True),
]

# Training-only phrasings (`repo.phrase` composes them with an opening and a closing)
TRAIN_PHRASINGS = (
    "Please add `{sig}` in `{path}`. {doc} {example}Write a test for it too{where}.",
    "I need a new function in `{path}`: `{sig}`. {doc} {example}Test it{where}.",
    "Add `{sig}` to {pkg} (file `{path}`). What it should do: {doc} {example}A test is "
    "required{where}.",
    "{pkg} lacks `{sig}`. Put it in `{path}`. {doc} {example}Cover it with a test{where}.",
    "Create the function `{sig}` inside `{path}`. {doc} {example}And add a test{where}.",
    "New helper, please: `{sig}`, in `{path}`. {doc} {example}Don't forget a test{where}.",
    "Implement a new `{sig}` in `{path}`. {doc} {example}Include a test{where}.",
    "`{path}` should get a function `{sig}`. {doc} {example}Test it as well{where}.",
)


def build(ctx: Context) -> Draft:
    rng, d, pkg = ctx.rng, ctx.difficulty, ctx.pkg
    feature = ctx.func()
    mod = ctx.module()
    path = f"{pkg}/{mod}.py"
    existing = [ctx.func() for _ in range(rng.randint(1, d + 1))]
    doc = module_doc(ctx, mod)
    modules = {mod: module_source(doc, [f.code for f in existing], func_imports(existing))}
    if d >= 2:
        other = ctx.module()
        extra = [ctx.func() for _ in range(rng.randint(1, 2))]
        modules[other] = module_source(module_doc(ctx, other), [f.code for f in extra],
                                       func_imports(extra))
    exports = {mod: [existing[0].name]} if d == 3 and rng.random() < 0.5 else None
    files = package_files(ctx, modules, exports)
    visible_test = f"tests/test_{mod}.py"
    files[visible_test] = test_source({f"{pkg}.{mod}": [f.name for f in existing]},
                                      [t for f in existing for t in case_tests(f, ctx.cases(f, 2))])

    cases = ctx.cases(feature, 6)
    params = re.match(r"def \w+\((.*)\):", feature.raw).group(1)
    sig = f"{feature.name}({params})"
    example, shown = "", cases[:1]
    if d < 3 or rng.random() < 0.5:
        pool = cases[len(feature.kernel.edge):] or cases
        shown = [min(pool, key=lambda c: len(repr(c)))]
        args, (_, value) = shown[0]
        example = f"For example, `{feature.call(args)}` returns `{value!r}`. "
    test_path = f"tests/test_{feature.name}.py"
    where = {1: f" in `{test_path}`", 2: rng.choice(["", " under `tests/`"]), 3: ""}[d]
    instruction = phrase(ctx, PHRASES, TRAIN_PHRASINGS, sig=sig, path=path, doc=feature.doc,
                         example=example, where=where, pkg=pkg)
    if d == 3:
        instruction += f" Export it from the package too, so `from {pkg} import " \
                       f"{feature.name}` works."

    hidden = case_tests(feature, cases, prefix="test_feature")
    hidden.append(("test_the_feature_has_its_own_test", (
        "    here = pathlib.Path(__file__).resolve()\n"
        "    root = here.parents[1]\n"
        "    found = [p for p in root.rglob('test_*.py')\n"
        f"             if p.resolve() != here and {feature.name!r} in p.read_text()]\n"
        f"    assert found, 'no test mentions {feature.name}'\n")))
    extra_imports = ["import pathlib"]
    if d == 3:
        hidden.append(("test_it_is_exported", f"    assert {pkg}.{feature.name} is "
                                              f"{pkg}_{mod}.{feature.name}\n"))
        extra_imports += [f"import {pkg}", f"import {pkg}.{mod} as {pkg}_{mod}"]
    hidden_tests = {hidden_path(feature.name): test_source(
        {f"{pkg}.{mod}": [feature.name]}, hidden, extra_imports)}

    text = modules[mod]
    if all(imp in text for imp in func_imports([feature])):
        lines, k = text.rstrip("\n").split("\n"), 1
        while text.count("\n".join(lines[-k:])) > 1:
            k += 1
        tail = "\n".join(lines[-k:])
        edits = [call("edit_file", path=path, old=tail,
                      new=tail + "\n\n\n" + feature.code.rstrip("\n"))]
    else:
        content = module_source(doc, [f.code for f in existing + [feature]],
                                func_imports(existing + [feature]))
        edits = [call("write_file", path=path, content=content)]
    # the test asserts the task's own example: copied, where other cases would be values the
    # model must compute, and one wrong expected value fails the whole suite
    test_body = "".join(assert_line(feature.call(a), r) for a, r in shown)
    user_test = test_source({f"{pkg}.{mod}": [feature.name]},
                            [(f"test_{feature.name}", test_body)])
    edits.append(call("write_file", path=test_path, content=user_test))
    if d == 3:
        init = files[f"{pkg}/__init__.py"]
        line = f"from {pkg}.{mod} import {feature.name}"
        edits.append(add_import_call(init, f"{pkg}/__init__.py", line)
                     if not exports else call("edit_file", path=f"{pkg}/__init__.py",
                                              old=f"from {pkg}.{mod} import {existing[0].name}",
                                              new=f"from {pkg}.{mod} import {existing[0].name}, "
                                                  f"{feature.name}"))
    first = reads(ctx, [path])
    first["calls"].append(call("list_files", path="tests"))
    turns = [first, turn("And the existing tests, for their style.",
                         call("read_file", path=visible_test)),
             turn(rng.choice(["Adding the function and a test for it.",
                              "Writing the new function, then its test.",
                              "Implementing the feature with a test."]), *edits),
             tests_check(ctx, test_path if rng.random() < 0.8 else "")]
    summary = f"Added `{sig}` to {path} with a test in {test_path}."
    files = finish_repo(ctx, files, list(modules))
    return Draft(instruction, files, hidden_tests, {"turns": turns, "summary": summary},
                 {"kernel": feature.kernel.key})
