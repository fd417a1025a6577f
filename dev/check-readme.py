#!/usr/bin/env python3
"""Type-check every Python example of the README and of the reference (dev/REFERENCE.md) as it is printed:
each ```python block becomes a module of its own in a temporary directory, and mypy --strict checks them
all against loopclient.py (found on MYPYPATH, the checkout).  An error is reported at its document's line.

Usage: dev/check-readme.py [--mypy MYPY] [MYPY_ARGUMENT...]
    --mypy MYPY   the mypy to run (default: mypy on PATH, else the devtools' under the cache)
    the rest goes to mypy, e.g. --python-version 3.8
Exit 0 when every example type-checks, 1 when one does not (mypy's lines, in document lines), 2 when there
is no example or no mypy.  `python3 dev/check-readme.py --list` prints the blocks' first lines instead.
.ci/run runs it with mypy --strict, and with mypy 1.14.1 --python-version 3.8.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The documents whose ```python blocks are examples, relative to the checkout.
DOCUMENTS = ("README.md", "dev/REFERENCE.md")
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)


def python_blocks(text):
    """The ```python blocks of ``text``: (the line of the block's first line of code, the code)."""
    return [(text.count("\n", 0, found.start()) + 2, found.group(1)) for found in BLOCK.finditer(text)]


def document_blocks(documents=DOCUMENTS):
    """The ```python blocks of the documents: (document, line, code)."""
    blocks = []
    for name in documents:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            blocks += [(name, line, code) for line, code in python_blocks(f.read())]
    return blocks


def default_mypy():
    found = shutil.which("mypy")
    if found:
        return found
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "loopclient", "devtools", "bin", "mypy")


def check(blocks, mypy, extra=()):
    """mypy --strict on ``blocks`` ((document, line, code)), each a module ``example_N.py``; returns (exit
    status, report lines), mypy's lines naming the document and its line."""
    where = tempfile.mkdtemp(prefix="loopclient-readme.")
    try:
        names = {}
        for number, (document, line, code) in enumerate(blocks):
            name = "example_%d.py" % number
            names[name] = (document, line)
            with open(os.path.join(where, name), "w", encoding="utf-8") as f:
                f.write(code)
        argv = [mypy, "--strict", "--no-incremental", "--cache-dir=/dev/null", *extra, *sorted(names)]
        env = dict(os.environ, MYPYPATH=ROOT)
        done = subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    report = []
    for text in (done.stdout + done.stderr).splitlines():
        found = re.match(r"(example_\d+\.py):(\d+):(.*)", text)
        if found and found.group(1) in names:
            document, line = names[found.group(1)]
            text = "%s:%d:%s" % (document, line + int(found.group(2)) - 1, found.group(3))
        report.append(text)
    return done.returncode, report


def main(argv):
    blocks = document_blocks()
    if not blocks:
        print("check-readme: no ```python block in %s" % ", ".join(DOCUMENTS), file=sys.stderr)
        return 2
    if argv[:1] == ["--list"]:
        for document, line, code in blocks:
            print("%s:%d: %s" % (document, line, code.splitlines()[0]))
        return 0
    mypy = default_mypy()
    if argv[:1] == ["--mypy"]:
        if len(argv) < 2:
            print("check-readme: --mypy needs the path of a mypy", file=sys.stderr)
            return 2
        mypy, argv = argv[1], argv[2:]
    if not os.path.exists(mypy) and not shutil.which(mypy):
        print("check-readme: no mypy at %s (give --mypy MYPY)" % mypy, file=sys.stderr)
        return 2
    code, report = check(blocks, mypy, argv)
    for text in report:
        print(text)
    print("check-readme: %d examples, %s" % (len(blocks), "ok" if code == 0 else "mypy failed (exit %d)" % code))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
