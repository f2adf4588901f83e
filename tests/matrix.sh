#!/usr/bin/env bash
# The unit tests and the quickstart on every supported torch, one venv each; prints a Markdown
# table for docs/COMPATIBILITY.md and the reason of every skip. Run it before each release.
#
#   tests/matrix.sh [VENV_ROOT]                    # default: $CGCOMPILE_VENVS, else ~/.cache/...
#   TORCH_VERSIONS="2.9.1 2.14.1" tests/matrix.sh /work/venvs
#
# A venv (VENV_ROOT/torch-X) is built once, with torch and the test extras, and reused: most
# torch releases come from PyPI as CUDA builds of several GB each. Every run installs this
# checkout into each venv (editable, no deps), because the backend is found by its entry point.
# Logs: VENV_ROOT/logs/torch-X-{build,unit,quickstart}.log. Exits 1 unless every version passed.
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="${1:-${CGCOMPILE_VENVS:-$HOME/.cache/cgcompile-venvs}}"
VERSIONS="${TORCH_VERSIONS:-2.9.1 2.10.0 2.11.0 2.12.1 2.13.0 2.14.1}"
PYTHON="${PYTHON:-python3}"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"  # as in .ci/run
LOGS="$ROOT/logs"
mkdir -p "$LOGS"
# the tree under test, read before the run: the venvs import this checkout as it is
commit=$(git -C "$REPO" rev-parse --short HEAD)
git -C "$REPO" diff --quiet HEAD || commit="$commit (uncommitted changes)"

has_torch() {  # $1 venv, $2 version: the venv's torch is that release
    "$1/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$2')" \
        2>/dev/null
}

build_venv() {  # $1 venv, $2 version; the test extras (transformers too) are added when missing
    if ! has_torch "$1" "$2"; then
        echo "building $1 (torch $2) ..." >&2
        "$PYTHON" -m venv "$1" &&
            "$1/bin/pip" install -q --no-cache-dir "torch==$2" "pytest>=7" "hypothesis>=6" numpy ||
            return 1
    fi
    "$1/bin/python" -c "import transformers" 2>/dev/null ||
        "$1/bin/pip" install -q --no-cache-dir "transformers>=4.56"
}

summary() {  # pytest's closing line without warnings and timing: "294 passed, 16 skipped"
    tail -n 1 "$1" | tr -d '=' | sed -E 's/, [0-9]+ warnings?//; s/ in [0-9.]+s.*//; s/^ +//'
}

rows=()
failed=0
for v in $VERSIONS; do
    venv="$ROOT/torch-$v"
    if ! build_venv "$venv" "$v" >"$LOGS/torch-$v-build.log" 2>&1 ||
        ! "$venv/bin/pip" install -q --no-deps -e "$REPO" \
            >>"$LOGS/torch-$v-build.log" 2>&1; then
        rows+=("| $v | venv build failed ($LOGS/torch-$v-build.log) | - | - |")
        failed=1
        continue
    fi
    echo "torch $v: unit tests ..." >&2
    (cd "$REPO" && "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs tests/unit) \
        >"$LOGS/torch-$v-unit.log" 2>&1
    unit_rc=$?
    echo "torch $v: quickstart ..." >&2
    (cd "$REPO" && "$venv/bin/python" examples/quickstart.py --compiler inductor) \
        >"$LOGS/torch-$v-quickstart.log" 2>&1
    quick_rc=$?
    quick=$([ $quick_rc -eq 0 ] && echo ok || echo "FAILED (rc $quick_rc)")
    one_trace=$("$venv/bin/python" -c "from cgcompile.torch_features import SHARED_UNBACKED_BATCH
print('yes' if SHARED_UNBACKED_BATCH.available else 'no')")
    full=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
    rows+=("| $full | $(summary "$LOGS/torch-$v-unit.log") | $quick | $one_trace |")
    [ $unit_rc -eq 0 ] && [ $quick_rc -eq 0 ] || failed=1
done

echo
echo "Matrix run $(date -u +%Y-%m-%d), commit $commit, $("$PYTHON" --version), CPU only"
echo "(\`tests/unit\` with HYPOTHESIS_PROFILE=$HYPOTHESIS_PROFILE; \`examples/quickstart.py\`)"
echo
echo "| torch | unit tests | quickstart | one-trace unbacked batch |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
echo
echo "Skip reasons (count, torch, reason):"
for v in $VERSIONS; do
    [ -f "$LOGS/torch-$v-unit.log" ] || continue
    grep -E '^SKIPPED \[' "$LOGS/torch-$v-unit.log" |
        sed -E "s/^SKIPPED \[([0-9]+)\] [^ ]+: /\1 $v /" |
        awk '{ n[substr($0, index($0, $2))] += $1 } END { for (k in n) print "  " n[k], k }'
done
exit $failed
