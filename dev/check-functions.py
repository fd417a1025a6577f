#!/usr/bin/env python3
"""The house rule on function size, checked: no function of loopclient.py outside the parsers is longer than
40 lines or has more than 15 branches.  ``.ci/run`` runs it as a gate.

    python3 dev/check-functions.py            # exit 1, naming each function over a limit
    python3 dev/check-functions.py --all      # the parsers' functions over a limit too (not a failure)

How it counts, on the source as written (``ast``):

- **lines**: the physical lines of the function's body after its docstring, from the line after the
  docstring (or the first statement's line, without one) to the function's last line: blank lines and
  comment lines inside the body count, a decorator and the ``def`` line (however many lines its signature
  takes) do not.  A function nested in another counts in its parent too (it is part of it).
- **branches**: each ``if`` and ``elif``, each ``for`` and ``while`` (one more for its ``else``), each
  ``except`` clause (one more for a ``try``'s ``else``), each ``case`` of a ``match``; the branches of a
  nested function or class are its own, not its parent's.  Each ``and``/``or`` (``a and b or c`` is two); conditional expressions and comprehensions are
  not branches.
- **the parsers** are sections 2 to 5 of the file (its numbered banners: the HTTP response, the SSE decoder,
  the assembler and the dialects, the response pump), which take bytes and return values: a state machine
  over bytes is clearer as one loop than split, and their speed is the stream's.  Every other section
  (errors and values, addresses and waits, gates, the request logic, the drivers, the clients, the command
  line) keeps the limits.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 40
MAX_BRANCHES = 15
PARSER_SECTIONS = (2, 3, 4, 5)


def body_lines(fn: ast.AST) -> int:
    """The lines of ``fn``'s body after its docstring."""
    body = fn.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        if len(body) == 1:
            return 0
        start = first.end_lineno + 1
    else:
        start = first.lineno
    return fn.end_lineno - start + 1


def branches(fn: ast.AST) -> int:
    """The branches of ``fn`` itself (those of the functions and classes it defines are theirs)."""
    count = 0
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.If):
            count += 1
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            count += 1 + bool(node.orelse)
        elif isinstance(node, ast.Try):
            count += len(node.handlers) + bool(node.orelse)
        elif type(node).__name__ == "match_case":
            count += 1
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        todo.extend(ast.iter_child_nodes(node))
    return count


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function, nested ones and methods included, in the file's order."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="also list the parsers' functions over a limit")
    parser.add_argument("path", nargs="?", default=os.path.join(ROOT, "loopclient.py"))
    args = parser.parse_args(argv)
    with open(args.path, encoding="utf-8") as f:
        source = f.read()
    banners = [
        (i + 1, int(m.group(1)))
        for i, line in enumerate(source.split("\n"))
        for m in [re.match(r"# (\d+)\. ", line)]
        if m
    ]
    over = []
    for name, fn in functions(ast.parse(source)):
        section = max([n for line, n in banners if line <= fn.lineno], default=0)
        lines, count = body_lines(fn), branches(fn)
        if lines > MAX_LINES or count > MAX_BRANCHES:
            parsers = section in PARSER_SECTIONS
            if parsers and not args.all:
                continue
            over.append(
                (
                    parsers,
                    "%s:%d %s: %d lines, %d branches (section %d%s)"
                    % (
                        os.path.basename(args.path),
                        fn.lineno,
                        name,
                        lines,
                        count,
                        section,
                        ", a parser" if parsers else "",
                    ),
                )
            )
    for _, text in over:
        print(text)
    failed = [text for parsers, text in over if not parsers]
    if failed:
        print("%d functions outside the parsers over %d lines or %d branches" % (len(failed), MAX_LINES, MAX_BRANCHES))
        return 1
    print("every function outside the parsers: at most %d lines and %d branches" % (MAX_LINES, MAX_BRANCHES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
