"""Write the tables of dev/FAULTS.md from the fault table the tests run (``FAULT_TABLE`` in
test_loopclient.py): ``python3 dev/faults.py``.  The prose around the tables is the file's own."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import test_loopclient  # noqa: E402 - after the path

path = os.path.join(HERE, "FAULTS.md")
with open(path, encoding="utf-8") as f:
    text = f.read()
new = test_loopclient.fault_tables_markdown(text)
if new != text:
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
print("dev/FAULTS.md %s" % ("written" if new != text else "unchanged"))
