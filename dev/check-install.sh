#!/usr/bin/env bash
# Packaging check: loopclient installs with pip and the install leaves the checkout as it was.
#
# Usage: dev/check-install.sh [PYTHON...]     (default: python3; each interpreter is checked in turn)
#
# For each interpreter, in throwaway virtual environments under a temporary directory:
#   1. `pip wheel` on a copy of the checkout (the files git tracks or would track, committed or not):
#      setuptools builds in the source tree, writing build/ and loopclient.egg-info/ there, so the build
#      runs out of tree; the wheel must hold exactly loopclient.py (byte for byte), the same bytes as
#      loopclient-stubs/__init__.pyi (the types a checker of the installed copy reads) and its metadata;
#   2. `pip install` of that wheel, then the installed `loopclient --version` must print the version, and
#      mypy (--python-executable of that environment) must check a small program against the installed
#      copy: a clean one passes, one with a deliberate type error fails with that error (mypy is
#      $LOOPCLIENT_MYPY, else mypy on PATH, else the devtools' under the cache; none: skipped, a failure
#      under CI=true);
#   3. `pip install .` in the copy, as the README documents, and the same --version check;
#   4. `pip install git+file://CHECKOUT` (the committed HEAD, as `pip install git+URL` fetches it;
#      skipped when the checkout has uncommitted changes, a failure under CI=true).
# Then the checkout must hold no build/, dist/ or *.egg-info, and `git status --porcelain --ignored` must
# read as it did before. Needs PyPI (build isolation fetches setuptools). Last line: "check-install: ok".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
say() { printf 'check-install: %s\n' "$*" >&2; }
fail() { say "FAIL: $*"; exit 1; }

(($# > 0)) || set -- python3
before=$(git status --porcelain --ignored)
VERSION=$(python3 -S -c 'import sys; sys.path.insert(0, sys.argv[1]); import loopclient; print(loopclient.__version__)' "$ROOT")
TMP=$(mktemp -d /tmp/loopclient-install.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
PIP=(-m pip --disable-pip-version-check --no-input -q)

mkdir "$TMP/src"
git ls-files -z --cached --others --exclude-standard |
    tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$TMP/src"
[[ -f $TMP/src/setup.cfg && -f $TMP/src/pyproject.toml ]] || fail "the copy has no setup.cfg or pyproject.toml"

check_version() { # check_version VENV HOW
    local out
    out=$(cd "$TMP" && "$1/bin/loopclient" --version 2>&1) || fail "$2: loopclient --version failed: $out"
    [[ $out == "loopclient $VERSION" ]] || fail "$2: loopclient --version printed '$out', expected 'loopclient $VERSION'"
    local where
    where=$(cd "$TMP" && "$1/bin/python" -c 'import loopclient; print(loopclient.__file__)')
    [[ $where == "$1"/* ]] || fail "$2: loopclient imported from $where, not from the virtual environment"
    say "$2: $out"
}

MYPY=${LOOPCLIENT_MYPY:-$(command -v mypy || echo "${XDG_CACHE_HOME:-$HOME/.cache}/loopclient/devtools/bin/mypy")}
check_types() { # check_types VENV HOW: mypy reads the installed copy's types
    if [[ ! -x $MYPY ]]; then
        [[ ${CI:-} != true ]] || fail "$2: no mypy to check the installed copy's types (set LOOPCLIENT_MYPY)"
        say "$2: types not checked: no mypy (set LOOPCLIENT_MYPY)"
        return 0
    fi
    mkdir -p "$TMP/types"
    printf 'import loopclient\n\nclient = loopclient.Client("/tmp/x.sock")\naddress: str = client.address\nclient.close()\n' >"$TMP/types/good.py"
    printf 'import loopclient\n\nlimits: int = loopclient.Limits()\n' >"$TMP/types/bad.py"
    local out
    out=$(cd "$TMP/types" && "$MYPY" --strict --no-incremental --cache-dir=/dev/null --python-executable "$1/bin/python" good.py 2>&1) ||
        fail "$2: mypy on a program using the installed copy: $out"
    if out=$(cd "$TMP/types" && "$MYPY" --strict --no-incremental --cache-dir=/dev/null --python-executable "$1/bin/python" bad.py 2>&1); then
        fail "$2: mypy found no error in a program with a type error: $out"
    fi
    [[ $out == *'bad.py:3: error: Incompatible types in assignment (expression has type "Limits", variable has type "int")'* ]] ||
        fail "$2: mypy did not report the deliberate type error: $out"
    say "$2: mypy reads the installed copy's types (a deliberate error is reported)"
}

n=0
for py in "$@"; do
    n=$((n + 1))
    label="$($py --version 2>&1)"
    say "$label"
    # 1. the wheel, built out of tree
    "$py" -m venv "$TMP/wheel$n"
    rm -rf "$TMP/src/build" "$TMP/src"/*.egg-info
    "$TMP/wheel$n/bin/python" "${PIP[@]}" wheel --no-deps -w "$TMP/dist$n" "$TMP/src"
    wheels=("$TMP/dist$n"/loopclient-"$VERSION"-*.whl)
    [[ ${#wheels[@]} == 1 && -f ${wheels[0]} ]] || fail "expected one wheel loopclient-$VERSION-*.whl, found: $(ls "$TMP/dist$n")"
    "$TMP/wheel$n/bin/python" - "${wheels[0]}" "$ROOT/loopclient.py" "$VERSION" <<'PY' || fail "wheel contents"
import sys, zipfile
whl, source, version = sys.argv[1:]
names = sorted(zipfile.ZipFile(whl).namelist())
info = "loopclient-%s.dist-info/" % version
stub = "loopclient-stubs/__init__.pyi"
extra = [n for n in names if n not in ("loopclient.py", stub) and not n.startswith(info)]
if extra or "loopclient.py" not in names or stub not in names:
    sys.exit("unexpected wheel contents: %s" % names)
if zipfile.ZipFile(whl).read("loopclient.py") != open(source, "rb").read():
    sys.exit("the wheel's loopclient.py differs from the checkout's")
if zipfile.ZipFile(whl).read(stub) != open(source, "rb").read():
    sys.exit("the wheel's %s is not the checkout's loopclient.py" % stub)
entry = zipfile.ZipFile(whl).read(info + "entry_points.txt").decode()
if "loopclient = loopclient:main" not in entry:
    sys.exit("no console script in entry_points.txt: %r" % entry)
print("check-install: wheel %s: %s" % (whl.rsplit("/", 1)[1], ", ".join(names)), file=sys.stderr)
PY
    # 2. installed from the wheel
    "$TMP/wheel$n/bin/python" "${PIP[@]}" install "${wheels[0]}"
    check_version "$TMP/wheel$n" "$label, from the wheel"
    check_types "$TMP/wheel$n" "$label, from the wheel"
    # 3. pip install . (in the copy)
    "$py" -m venv "$TMP/dot$n"
    (cd "$TMP/src" && "$TMP/dot$n/bin/python" "${PIP[@]}" install .)
    check_version "$TMP/dot$n" "$label, pip install ."
    check_types "$TMP/dot$n" "$label, pip install ."
    # 4. pip install git+file:// (HEAD of the checkout; only meaningful when HEAD is what is checked out)
    if [[ -n $(git status --porcelain) ]]; then
        [[ ${CI:-} != true ]] || fail "the checkout has uncommitted changes (CI checks a clean clone): $(git status --porcelain)"
        say "$label, pip install git+file://: skipped, the checkout has uncommitted changes"
    else
        "$py" -m venv "$TMP/git$n"
        "$TMP/git$n/bin/python" "${PIP[@]}" install "git+file://$ROOT"
        check_version "$TMP/git$n" "$label, pip install git+file://$ROOT"
    fi
done

for junk in build dist ./*.egg-info; do
    [[ ! -e $junk ]] || fail "the checkout now holds $junk"
done
after=$(git status --porcelain --ignored)
[[ $after == "$before" ]] || fail "git status changed:"$'\n'"before:"$'\n'"$before"$'\n'"after:"$'\n'"$after"
say "ok"
