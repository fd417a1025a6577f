"""Write the tables of dev/FAULTS.md from the fault table the tests run (``FAULT_TABLE`` in
test_loopclient.py): ``python3 dev/faults.py``.  The prose around the tables is the file's own.

``python3 dev/faults.py --restated`` counts instead the fault literals stated in more than one place: the
str and bytes literals of 12 characters or more (docstrings aside) that stand in more than one place of
the fault tier (test_loopclient.py from its "# Tier 4." banner to its "# Tier 5." one), a place being a
top-level definition there (a helper, a constant, a TestFault* class, TestDifferential), the functions
that make FAULT_TABLE's sections (``@_d_section``: its rows and their parts) counting as one, the table.
Each such literal is printed with its places; the exit status is 1 when there are more than RESTATED_MOST.
"""

import argparse
import ast
import collections
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: How many restated literals the fault tier may hold (a row name or a server's bytes said twice is a fault
#: stated twice; a few short protocol words are not worth a name).
RESTATED_MOST = 10


def _places(tree, lines):
    """{place: [top-level nodes]} of the fault tier."""
    first = next(i for i, line in enumerate(lines, 1) if line.startswith("# Tier 4."))
    last = next(i for i, line in enumerate(lines, 1) if line.startswith("# Tier 5."))
    places = collections.defaultdict(list)
    for node in tree.body:
        if not first < node.lineno < last:
            continue
        decorators = getattr(node, "decorator_list", ())
        if any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == "_d_section" for d in decorators):
            places["FAULT_TABLE"].append(node)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            places[node.name].append(node)
        else:  # an assignment (its first name), or a statement (by its line)
            names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
            places[names[0] if names else "line %d" % node.lineno].append(node)
    return places


def restated(path=None):
    """{literal: sorted places} of the literals that stand in more than one place of the fault tier (of
    test_loopclient.py, or the file at ``path``)."""
    with open(path or os.path.join(ROOT, "test_loopclient.py"), encoding="utf-8") as f:
        text = f.read()
    tree = ast.parse(text)
    seen = collections.defaultdict(set)
    for place, nodes in _places(tree, text.split("\n")).items():
        for node in nodes:
            docs = {
                id(n.body[0].value)
                for n in ast.walk(node)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and isinstance(n.body[0], ast.Expr)
                and isinstance(n.body[0].value, ast.Constant)
            }
            for n in ast.walk(node):
                literal = isinstance(n, ast.Constant) and isinstance(n.value, (str, bytes)) and id(n) not in docs
                if literal and len(n.value) >= 12:
                    seen[n.value].add(place)
    return {literal: sorted(places) for literal, places in seen.items() if len(places) > 1}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--restated", action="store_true", help="count the fault literals stated more than once")
    args = parser.parse_args(argv)
    if args.restated:
        found = restated()
        for literal, places in sorted(found.items(), key=lambda item: repr(item[0])):
            print("%-60s %s" % (repr(literal)[:60], ", ".join(places)))
        print("%d literals of the fault tier stand in more than one place (at most %d)" % (len(found), RESTATED_MOST))
        return 1 if len(found) > RESTATED_MOST else 0
    sys.path.insert(0, ROOT)
    import test_loopclient

    path = os.path.join(HERE, "FAULTS.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    new = test_loopclient.fault_tables_markdown(text)
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    print("dev/FAULTS.md %s" % ("written" if new != text else "unchanged"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
