"""Family `fix_bug`: one planted bug (wrong operator, off-by-one, wrong constant, inverted
condition) in a function of a small package.

Difficulty 1: the buggy function and a distractor in one module, the instruction names the
function. 2: more distractors and a second module. 3: the instruction only shows the symptom
through a function in another module that calls the buggy one. Hidden tests check the fixed
function (and the caller) on inputs where the bug shows.
"""

from __future__ import annotations

from learner.tasks.repo import (Context, Draft, Phrase, Retry, case_tests, describe, differs,
                                edit_call, finish_repo, func_imports, hidden_path, make_caller,
                                module_doc, module_source, outcome, package_files, phrase,
                                python_check, reads, test_source, tests_check, turn, call,
                                assert_line)

NAME = "fix_bug"

PHRASES = [
    Phrase("`{call}` returns {actual}, but it should return {expected}. Please fix the bug in "
           "`{path}`."),
    Phrase("There is a bug in `{fn}` ({path}): `{call}` gives {actual} instead of {expected}. "
           "Fix it without changing the tests."),
    Phrase("Fix `{fn}` in the {pkg} package. Calling `{call}` should give {expected}; right now "
           "it gives {actual}."),
    Phrase("I think `{fn}` is broken: `{call}` yields {actual}, expected {expected}. Can you find "
           "and fix the problem?"),
    Phrase("`{fn}` in `{path}` has a bug. For example `{call}` should be {expected} but is "
           "{actual}. Make it correct."),
    Phrase("In the {pkg} package, `{call}` returns {actual} instead of {expected}. Find the cause "
           "and fix it."),
    Phrase("Something is wrong in {pkg}: `{call}` should give {expected}, but gives {actual}. "
           "Track down the bug and fix it; keep the tests as they are."),
    Phrase("Users report that `{call}` is {actual}; it must be {expected}. Fix the underlying "
           "bug."),
    # Training only, and only when a visible test shows the bug: the user names no function,
    # the agent runs the tests to find what fails (how people usually ask).
    Phrase("Fix {failing}."),
    Phrase("The tests fail. Find the bug and fix it ({failing} is in the {pkg} package)."),
    Phrase("`python -m pytest -q` fails: {failing}. Fix the code, not the tests."),
    Phrase("Bug report for {pkg}: {fn} misbehaves. Steps to reproduce: evaluate `{call}`. "
           "Expected {expected}, got {actual}. Please patch it.", heldout=True),
    Phrase("Wrong result from `{fn}`: with these arguments, `{call}`, we get {actual} where "
           "{expected} is right. Correct the implementation.", heldout=True),
    Phrase("Please investigate: `{call}` produces {actual} (should be {expected}). The bug may "
           "not be where it shows up.", heldout=True),
    Phrase("{pkg} regression: expected {expected} from `{call}`, observed {actual}. Fix it.",
           heldout=True),
]

# Training-only phrasings (`repo.phrase` composes them with an opening and a closing)
TRAIN_PHRASINGS = (
    "`{call}` should be {expected}, not {actual}. Fix the code.",
    "Expected `{call}` to return {expected}; it returns {actual}. Please fix it.",
    "The result of `{call}` is wrong: {actual} instead of {expected}.",
    "Can you fix {pkg}? `{call}` gives {actual}, but the right answer is {expected}.",
    "`{call}` -> {actual}, but it has to be {expected}. Find and fix the bug.",
    "When I evaluate `{call}` I get {actual}. It ought to be {expected}. Please repair it.",
    "A bug in {pkg} makes `{call}` return {actual}. The correct value is {expected}.",
    "`{fn}` is wrong: `{call}` is {actual}, should be {expected}. It lives in `{path}`.",
    "Please correct `{fn}` (`{path}`): for `{call}` it returns {actual} rather than {expected}.",
    "Got {actual} from `{call}`, wanted {expected}. Fix the bug and keep the tests.",
    "`{fn}` needs a fix: `{call}` must give {expected}, it gives {actual}.",
    "Something in `{fn}` is off. `{call}` returned {actual}; the answer is {expected}.",
)

KIND_WORDS = {"operator": "a wrong operator", "off_by_one": "an off-by-one error",
              "constant": "a wrong constant", "condition": "a wrong condition"}


def build(ctx: Context) -> Draft:
    rng, d, pkg = ctx.rng, ctx.difficulty, ctx.pkg
    target = ctx.func(where=lambda k: bool(k.bugs))
    bug = rng.choice(target.kernel.bugs)
    good, bad = target.sub(bug.old), target.sub(bug.new)
    if target.code.count(good) != 1:
        raise Retry(f"{target.kernel.key}: bug text not unique")
    bad_code = target.code.replace(good, bad)
    cases = ctx.cases(target, 6)
    bad_results = [outcome(target.body(bad_code), target.name, args) for args, _ in cases]
    shows = [i for i, (_, res) in enumerate(cases) if differs(res, bad_results[i])]
    if not shows:
        raise Retry(f"{target.kernel.key}/{bug.kind}: no input shows the bug")

    mod = ctx.module()
    distractors = [ctx.func() for _ in range(rng.randint(1, d + (d > 1)))]
    funcs = distractors[:]
    funcs.insert(rng.randint(0, len(funcs)), target)
    codes = [bad_code if f is target else f.code for f in funcs]
    modules = {mod: module_source(module_doc(ctx, mod), codes, func_imports(funcs))}
    path = f"{pkg}/{mod}.py"
    tests = [t for f in distractors for t in case_tests(f, ctx.cases(f, 2))]
    visible_target = d < 3 and rng.random() < 0.5
    if visible_target:
        args, res = cases[shows[0]]
        tests.append((f"test_{target.name}", assert_line(target.call(args), res)))
    names = [f.name for f in distractors] + [target.name] * visible_target
    files = {f"tests/test_{mod}.py": test_source({f"{pkg}.{mod}": names}, tests)}

    example = cases[shows[0]]
    shown_call, expected, actual = target.call(example[0]), describe(example[1]), \
        describe(bad_results[shows[0]])
    check_module, check_name = f"{pkg}.{mod}", target.name
    caller = None
    if d >= 2:
        other = ctx.module()
        extra = [ctx.func() for _ in range(rng.randint(1, 2))]
        other_codes = [f.code for f in extra]
        other_imports = func_imports(extra)
        if d == 3:
            caller = make_caller(ctx, target)
            other_codes.insert(rng.randint(0, len(other_codes)), caller.code())
            other_imports.append(f"from {pkg}.{mod} import {target.name}")
            shown_call = caller.call(example[0])
            expected = describe(caller.outcome(example[0]))
            actual = describe(caller.outcome(example[0], bad_code))
            check_module, check_name = f"{pkg}.{other}", caller.name
        modules[other] = module_source(module_doc(ctx, other), other_codes, other_imports)
        files[f"tests/test_{other}.py"] = test_source(
            {f"{pkg}.{other}": [f.name for f in extra]},
            [t for f in extra for t in case_tests(f, ctx.cases(f, 2))])
    files.update(package_files(ctx, modules))

    hidden = case_tests(target, cases, prefix="test_fixed")
    hidden_imports = {f"{pkg}.{mod}": [target.name]}
    if caller is not None:
        hidden_imports[check_module] = [caller.name]
        hidden.append((f"test_{caller.name}_uses_the_fix", "".join(
            f"    assert {caller.call(args)} == {caller.outcome(args)[1]!r}\n"
            for args, res in cases if res[0] == "ok")))
    hidden_tests = {hidden_path(target.name): test_source(hidden_imports, hidden)}

    fields = {"call": shown_call, "expected": expected, "actual": actual, "pkg": pkg}
    if caller is None:
        fields.update(fn=target.name, path=path)
    if visible_target:
        fields["failing"] = "the failing test"
    instruction = phrase(ctx, PHRASES, TRAIN_PHRASINGS, **fields)
    from_tests = "{failing}" in ctx.template

    turns = []
    if caller is not None:
        turns.append(turn("Let me find where that function is defined.",
                          call("grep", pattern=f"def {caller.name}\\b")))
        turns.append(reads(ctx, [f"{pkg}/{check_module.split('.')[-1]}.py"]))
        turns.append(turn(f"It calls `{target.name}` from `{path}`; reading that.",
                          call("read_file", path=path)))
    elif from_tests:                                    # run the tests, then read what failed
        turns.append(turn("Let me run the tests to see what fails.",
                          call("run_command", command="python -m pytest -q")))
        turns.append(reads(ctx, [f"tests/test_{mod}.py", path]))
    else:
        if path not in instruction or visible_target:   # find the function (and its test)
            # the bare name: a leading `\\b` glues its `b` onto the name's first letters
            # in the tokenizer's chunks (`\\bsum` is `\\`, `bs`, `um`), so copying the name
            # from the task (`sum`) is a different token sequence and small models drop letters
            turns.append(turn(f"Let me find `{target.name}`.",
                              call("grep", pattern=target.name)))
        turns.append(reads(ctx, [path] + ([f"tests/test_{mod}.py"] if visible_target else [])))
    fix = edit_call(modules[mod], bad, good, path, within=bad_code)
    turns.append(turn(f"The bug is {KIND_WORDS[bug.kind]} in `{target.name}`: `{bad.strip()}` "
                      f"should be `{good.strip()}`.", fix))
    call_expr = (caller or target).call(example[0])
    turns.append(python_check(ctx, check_module, [check_name], call_expr) if rng.random() < 0.7
                 else tests_check(ctx))
    summary = (f"Fixed {KIND_WORDS[bug.kind]} in `{target.name}` ({path}): `{bad.strip()}` is "
               f"now `{good.strip()}`, so `{shown_call}` returns {expected}.")
    files = finish_repo(ctx, files, list(modules))
    return Draft(instruction, files, hidden_tests, {"turns": turns, "summary": summary},
                 {"kernel": target.kernel.key, "bug": bug.kind})
