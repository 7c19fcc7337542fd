"""Family `fix_command`: a command-line entry point that crashes on its data file.

The package has `cli.py` (`python -m pkg.cli FILE` prints one summary line of a CSV file) and
a module with the aggregate it prints. One of: the code reads a column the file does not have
(KeyError), forgets to skip the header row (ValueError), concatenates a number to a string
(TypeError), reads the wrong argv slot (IndexError), or parses decimals with `int` (ValueError).
At difficulty 3 the CSV reading lives in a separate loader module. Hidden tests run the
command on the repository's file and on a fresh file, and check the printed line.
"""

from __future__ import annotations

from learner.tasks.repo import (Context, Draft, Phrase, call, case_tests, edit_call, finish_repo,
                                func_imports, hidden_path, module_doc, module_source, outcome,
                                package_files, phrase, reads, test_source, tests_check, turn)

NAME = "fix_command"

PHRASES = [
    Phrase("`{command}` fails with `{error}`. Make it work: it should print `{expected}`. "
           "{constraint}"),
    Phrase("Make `{command}` succeed (exit code 0, output `{expected}`). {constraint}"),
    Phrase("The command `{command}` crashes ({error}). Fix the program so that it prints "
           "`{expected}`. {constraint}"),
    Phrase("I can't run `{command}`; it dies with `{error}`. Please fix it. Expected output: "
           "`{expected}`. {constraint}"),
    Phrase("Our nightly job runs `{command}` and it has started failing with `{error}`. Get it "
           "working again; the correct output is `{expected}`. {constraint}", heldout=True),
    Phrase("Fix the {pkg} command line tool: `{command}` should print `{expected}` instead of "
           "failing. {constraint}", heldout=True),
]

# Training-only phrasings (`repo.phrase` composes them with an opening and a closing)
TRAIN_PHRASINGS = (
    "Running `{command}` gives `{error}`. It should print `{expected}`. {constraint}",
    "`{command}` is broken ({error}); make it print `{expected}`. {constraint}",
    "Please get `{command}` to work. It should output `{expected}`, but it fails: `{error}`. "
    "{constraint}",
    "Expected `{command}` to print `{expected}`; instead it fails with `{error}`. {constraint}",
    "Repair {pkg} so that `{command}` prints `{expected}`. Right now: `{error}`. {constraint}",
    "Fix `{command}`. Wanted output: `{expected}`. What happens: `{error}`. {constraint}",
)
CONSTRAINTS = ("Fix the program, not the data.", "Don't edit the CSV file; it is correct.",
               "The data file is fine; change the code.", "Leave `{data}` as it is.")
BREAKS = ("column", "header", "concat", "argv", "decimals")
NAMES = ("north", "south", "east", "west", "alpha", "beta", "gamma", "delta", "oak", "pine",
         "birch", "cedar", "amber", "coral", "ivory", "slate")

READER = '''\
def read_values(path):
    """The `{col}` column of the CSV file at `path`, as numbers."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{conv}(row["{col}"]) for row in rows]
'''
READER_PLAIN = '''\
def read_values(path):
    """The `{col}` column (the second) of the CSV file at `path`, as numbers."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))[1:]
    return [{conv}(row[1]) for row in rows]
'''
MAIN = '''\
def main(argv):
    if len(argv) != 1:
        print("usage: python -m {pkg}.cli FILE", file=sys.stderr)
        return 2
    values = read_values(argv[0])
    print(f"{label}: {{{agg}(values)}}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


def _csv(rng, col: str, decimals: bool) -> tuple[str, list]:
    names = rng.sample(NAMES, rng.randint(3, 7))
    values = [rng.randint(1, 90) + (rng.choice([0.25, 0.5, 0.75]) if decimals else 0)
              for _ in names]
    text = f"name,{col}\n" + "".join(f"{n},{v}\n" for n, v in zip(names, values))
    return text, values


def build(ctx: Context) -> Draft:
    rng, d, pkg = ctx.rng, ctx.difficulty, ctx.pkg
    brk = rng.choice(BREAKS)
    agg = ctx.func(where=lambda k: bool(k.label))
    col = agg.names["S"]
    label = f"{agg.kernel.label} {agg.names['Ph']}"
    mod = ctx.module()
    others = [ctx.func() for _ in range(d - 1 + rng.randint(0, 1))]
    funcs = others[:]
    funcs.insert(rng.randint(0, len(funcs)), agg)
    modules = {mod: module_source(module_doc(ctx, mod), [f.code for f in funcs],
                                  func_imports(funcs))}
    decimals = brk == "decimals"
    data = rng.choice([f"data/{agg.names['P']}.csv", f"{agg.names['P']}.csv",
                       f"samples/{agg.names['P']}_2024.csv"])
    data_text, values = _csv(rng, col, decimals)
    other_text, other_values = _csv(rng, col, decimals)
    conv = "float" if decimals else "int"

    reader = (READER_PLAIN if brk == "header" else READER).format(col=col, conv=conv)
    main = MAIN.format(pkg=pkg, label=label, agg=agg.name)
    value = outcome(agg.body(), agg.name, (values,))[1]
    bad_reader, bad_main, error, old, new = _break(rng, brk, reader, main, agg, col, label,
                                                   values, value)
    expected = f"{label}: {value}"
    expected_other = f"{label}: {outcome(agg.body(), agg.name, (other_values,))[1]}"

    cli_doc = (f'"""Command line for {pkg}: print the {label} in a CSV file.\n\n'
               f'Usage: python -m {pkg}.cli FILE\n"""\n\n')
    if d == 3:
        loader = ctx.module()
        modules[loader] = module_source(f"Reading {agg.names['Ph']} from CSV files.",
                                        [bad_reader], ["import csv"])
        cli = cli_doc + f"import sys\n\nfrom {pkg}.{loader} import read_values\n" \
            f"from {pkg}.{mod} import {agg.name}\n\n\n" + bad_main
        broken = f"{pkg}/{loader}.py" if bad_reader != reader else f"{pkg}/cli.py"
    else:
        cli = cli_doc + f"import csv\nimport sys\n\nfrom {pkg}.{mod} import {agg.name}\n\n\n" \
            + bad_reader + "\n\n" + bad_main
        broken = f"{pkg}/cli.py"
    files = package_files(ctx, modules)
    files[f"{pkg}/cli.py"] = cli
    files[data] = data_text
    if others:
        files[f"tests/test_{mod}.py"] = test_source(
            {f"{pkg}.{mod}": [f.name for f in others]},
            [t for f in others for t in case_tests(f, ctx.cases(f, 2))])

    hidden_tests = {hidden_path("cli"): _hidden_source(pkg, data, expected, other_text,
                                                       expected_other)}
    command = f"python -m {pkg}.cli {data}"
    constraint = rng.choice(CONSTRAINTS).format(data=data)
    instruction = phrase(ctx, PHRASES, TRAIN_PHRASINGS, command=command, error=error,
                         expected=expected, constraint=constraint, pkg=pkg)
    to_read = [f"{pkg}/cli.py"] + ([broken] if broken != f"{pkg}/cli.py" else [])
    turns = [turn("Let me run it and look at the traceback.", call("run_command", command=command)),
             reads(ctx, to_read),
             turn(f"Found it: `{old}` should be `{new}`.",
                  edit_call(files[broken], old, new, broken)),
             turn("Running the command again.", call("run_command", command=command))]
    if rng.random() < 0.15:
        turns.append(tests_check(ctx))
    summary = f"Fixed {broken}: `{old}` -> `{new}`. `{command}` now prints `{expected}`."
    files = finish_repo(ctx, files, list(modules) + ["cli"])
    return Draft(instruction, files, hidden_tests, {"turns": turns, "summary": summary},
                 {"kernel": agg.kernel.key, "break": brk})


def _break(rng, brk: str, reader: str, main: str, agg, col: str, label: str, values: list,
           value) -> tuple[str, str, str, str, str]:
    """(reader, main, error, old, new): the broken code, its error, and the oracle's edit."""
    if brk == "column":
        wrong = rng.choice([c for c in (agg.names["P"], col.split("_")[-1] + "_value", "value",
                                        "amount", "qty") if c != col])
        return (reader.replace(f'row["{col}"]', f'row["{wrong}"]'), main, f"KeyError: '{wrong}'",
                f'row["{wrong}"]', f'row["{col}"]')
    if brk == "header":
        return (reader.replace("list(csv.reader(f))[1:]", "list(csv.reader(f))"), main,
                f"ValueError: invalid literal for int() with base 10: '{col}'",
                "list(csv.reader(f))", "list(csv.reader(f))[1:]")
    if brk == "concat":
        good = f'print(f"{label}: {{{agg.name}(values)}}")'
        bad = f'print("{label}: " + {agg.name}(values))'
        return (reader, main.replace(good, bad),
                f'TypeError: can only concatenate str (not "{type(value).__name__}") to str',
                bad, good)
    if brk == "argv":
        return (reader, main.replace("read_values(argv[0])", "read_values(argv[1])"),
                "IndexError: list index out of range", "argv[1]", "argv[0]")
    return (reader.replace("float(row", "int(row"), main,
            f"ValueError: invalid literal for int() with base 10: '{values[0]}'",
            f'int(row["{col}"])', f'float(row["{col}"])')


def _hidden_source(pkg: str, data: str, expected: str, other_csv: str, expected_other: str) -> str:
    return f'''import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "{pkg}.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_command_on_the_repository_data():
    out = run_cli({data!r})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == {expected!r}


def test_command_on_another_file(tmp_path):
    other = tmp_path / "other.csv"
    other.write_text({other_csv!r})
    out = run_cli(str(other))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == {expected_other!r}


def test_usage_without_a_file():
    assert run_cli().returncode == 2
'''
