#!/usr/bin/env bash
# Every supported SGLang release (or those named) under `pdo conform sglang`, one after another:
# installs the missing ones side by side (engine/sglang/versions.py), runs the whole conformance on
# each, and prints one line per release: its exit code, its outcomes, and which hooks attached.
# Each release's full output and traces are kept in $OUT (default: sglang-matrix/).
#
#   bash scripts/sglang-matrix.sh                # every release from 0.5.13 to 0.5.23
#   bash scripts/sglang-matrix.sh 0.5.16 0.5.23  # those
# Exit 0 when every release exited 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-sglang-matrix}
PY=.venv/bin/python
mapfile -t releases < <(if (($#)); then printf '%s\n' "$@"; else
  $PY -c 'from engine.sglang.versions import RELEASES; print("\n".join(RELEASES))'; fi)
mkdir -p "$OUT"
status=0
for v in "${releases[@]}"; do
  $PY -m engine.sglang.versions install "$v" >/dev/null || { echo "$v: install failed"; status=1; continue; }
  $PY -m engine.cli conform sglang --sglang-version "$v" --trace-dir "$OUT/$v" >"$OUT/$v.txt" 2>"$OUT/$v.err"
  rc=$?
  ((rc == 0)) || status=1
  outcomes=$(grep -E '^(ok |BAD) ' "$OUT/$v.txt" | awk '{print $1"/"$3}' | sort | uniq -c | awk '{printf "%s %s, ", $1, $2}')
  echo "$v: exit $rc; ${outcomes%, }"
  grep -E '^hooks:' "$OUT/$v.txt" | sed 's/^/    /'
  na=$(grep -c '^not applicable' "$OUT/$v.txt")
  ((na)) && echo "    $na scenarios not applicable (each with why in $OUT/$v.txt)"
done
exit $status
