"""Family `implement_function`: a stub whose docstring (with examples) says what it must do.

Difficulty 1: one stub next to one finished function. 2: more finished functions around it
and a second module. 3: two stubs in the same module. Hidden tests check every stub on the
documented behaviour, edge cases included.
"""

from __future__ import annotations

from learner.tasks.repo import (Context, Draft, Phrase, call, case_tests, finish_repo,
                                func_imports, hidden_path, module_doc, module_source,
                                package_files, phrase, reads, test_source,
                                tests_check, turn, with_docstring, edit_call)

NAME = "implement_function"

PHRASES = [
    Phrase("Implement {fn} in `{path}` as the docstring describes."),
    Phrase("{fn} in `{path}` is still a stub. Write the implementation so it matches the "
           "docstring and its examples."),
    Phrase("Please fill in the body of {fn} in the {pkg} package; the docstring says what it "
           "must do."),
    Phrase("Finish {fn} in `{path}`. The examples in the docstring must hold."),
    Phrase("Write the code for {fn} (`{path}`). Keep the signature and the docstring; make the "
           "documented examples true."),
    Phrase("TODO left in `{path}`: {fn} does not do anything useful yet. Provide a working "
           "implementation that follows the documented behaviour.", heldout=True),
    Phrase("Code the missing logic of {pkg}'s {fn}, found in `{path}`. Follow the docstring "
           "exactly, including the edge cases it mentions.", heldout=True),
]

# Training-only phrasings (`repo.phrase` composes them with an opening and a closing)
TRAIN_PHRASINGS = (
    "{fn} in `{path}` has no body yet. Write it from its docstring.",
    "Please implement `{fn}` (it is in `{path}`); the docstring is the spec.",
    "The body of {fn} is empty (`{path}`). Make it do what the docstring says.",
    "In {pkg}, `{fn}` only contains `...`. Implement it following its docstring and examples.",
    "Write {fn}. It is declared in {pkg} with a docstring that describes the behaviour.",
    "Fill in `{fn}` in `{path}` so that the docstring examples hold.",
    "{fn} needs an implementation; see its docstring in `{path}`.",
    "Complete the function {fn} in {pkg} according to its documentation.",
    "Can you write `{fn}`? It sits in `{path}` as a stub.",
    "`{fn}` is a stub right now. Give it a real body that matches its docstring.",
)

STUBS = ("    raise NotImplementedError\n", "    # TODO: implement\n    raise NotImplementedError\n",
         "    pass  # TODO\n", '    raise NotImplementedError("not written yet")\n', "    ...\n")


def _examples(func, cases) -> list[str]:
    out = []
    for args, (_, value) in cases:
        out += [f">>> {func.call(args)}", repr(value)]
    return out


def build(ctx: Context) -> Draft:
    rng, d, pkg = ctx.rng, ctx.difficulty, ctx.pkg
    n_stubs = 2 if d == 3 else 1
    targets = [ctx.func() for _ in range(n_stubs)]
    mod = ctx.module()
    path = f"{pkg}/{mod}.py"
    others = [ctx.func() for _ in range(rng.randint(1, 1 + d))]
    funcs = others[:]
    stubbed, solutions, all_cases = {}, {}, {}
    for t in targets:
        cases = ctx.cases(t, 6)
        shown = [c for c in cases if len(repr(c)) < 90][:2] or cases[:1]
        head, body = t.raw.split("\n", 1)
        stub_body = rng.choice(STUBS)
        stub = with_docstring(head + "\n" + stub_body, t.doc, _examples(t, shown))
        stubbed[t.name], solutions[t.name], all_cases[t.name] = stub, (stub_body, body), cases
        funcs.insert(rng.randint(0, len(funcs)), t)
    codes = [stubbed.get(f.name, f.code) for f in funcs]
    modules = {mod: module_source(module_doc(ctx, mod), codes, func_imports(funcs))}
    files = {f"tests/test_{mod}.py": test_source(
        {f"{pkg}.{mod}": [f.name for f in others]},
        [t for f in others for t in case_tests(f, ctx.cases(f, 2))])}
    if d >= 2:
        other = ctx.module()
        extra = [ctx.func() for _ in range(rng.randint(1, 2))]
        modules[other] = module_source(module_doc(ctx, other), [f.code for f in extra],
                                       func_imports(extra))
        files[f"tests/test_{other}.py"] = test_source(
            {f"{pkg}.{other}": [f.name for f in extra]},
            [t for f in extra for t in case_tests(f, ctx.cases(f, 2))])
    files.update(package_files(ctx, modules))

    hidden = [t for f in targets for t in case_tests(f, all_cases[f.name], prefix="test_impl")]
    hidden_tests = {hidden_path(targets[0].name): test_source(
        {f"{pkg}.{mod}": [t.name for t in targets]}, hidden)}

    fn = " and ".join(f"`{t.name}`" for t in targets)
    instruction = phrase(ctx, PHRASES, TRAIN_PHRASINGS, fn=fn, path=path, pkg=pkg)

    text = modules[mod]
    edits = []
    for t in targets:
        stub_body, body = solutions[t.name]
        edits.append(edit_call(text, stub_body, body, path, within=stubbed[t.name]))
        text = text.replace(stubbed[t.name], stubbed[t.name].replace(stub_body, body))
    turns = [] if path in instruction else [
        turn(f"Let me find {fn}.", call("grep", pattern=f"def {targets[0].name}\\b"))]
    turns += [reads(ctx, [path]),
             turn(rng.choice(["Writing the implementation.", "Now the body, following the "
                              "docstring.", "Implementing it as documented."]), *edits)]
    # the check runs the docstring's own examples: a `python -c` of a call would make the model
    # write arguments it has never seen (the cases the hidden tests use), and a wrong guess
    # (`sum_sides(10, 10)` for a one-list function) fails a right body and sends it to "fix" it
    if rng.random() < 0.7:
        say = rng.choice(["Running the docstring's examples.", "Checking the documented "
                          "examples.", "Let me run the examples in the docstring."])
        turns.append(turn(say, call("run_command",
                                    command=f"python -m doctest {path}")))
    else:
        turns.append(tests_check(ctx))
    summary = f"Implemented {fn} in {path} following the docstring; the examples hold."
    files = finish_repo(ctx, files, list(modules))
    return Draft(instruction, files, hidden_tests, {"turns": turns, "summary": summary},
                 {"kernels": [t.kernel.key for t in targets]})
