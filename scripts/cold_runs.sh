#!/usr/bin/env bash
# Cold and warm whole-suite runs on a GPU machine, as a GPU CI runner sees them: each IMPL is run
# from an empty Triton cache (a fresh TRITON_CACHE_DIR), then again with the cache it left (warm).
# Writes RESULTS/cold-IMPL.log, warm-IMPL.log, triton-IMPL.txt (compiled kernels by name) and
# RESULTS/cold.json ({impl: {cold_s, warm_s, exit, kernels}}). Run from the repository root:
#     RESULTS=out XDIST=4 bash scripts/cold_runs.sh reference flashmla
set -uo pipefail
OUT=${RESULTS:?set RESULTS to the results directory}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
IMPLS=("$@")
[ ${#IMPLS[@]} -gt 0 ] || IMPLS=(reference)
export PYTHONUNBUFFERED=1 PEERS_ENV_FUNCTIONS_ONLY=1
source scripts/peers_env.sh
peers_install_wheels
peers_pythonpath
peers_install_project
if [[ " ${IMPLS[*]} " == *" flashmla "* ]] || [[ " ${IMPLS[*]} " == *" flaggems "* ]]; then
  peers_flashmla >"$OUT/flashmla-setup.log" 2>&1
fi
echo "{}" >"$OUT/cold.json"
for impl in "${IMPLS[@]}"; do
  cache=$(mktemp -d /tmp/triton-cache.XXXXXX)
  xfail=()
  [ -f "pytest_sparse_mla/xfail/$impl.txt" ] && xfail=(--sparse-mla-xfail-file "pytest_sparse_mla/xfail/$impl.txt")
  for phase in cold warm; do
    t0=$(date +%s.%N)
    TRITON_CACHE_DIR=$cache timeout -s INT -k 20 "${SUITE_TIMEOUT:-240}" python3 -m pytest -p sparse_mla suites \
      --sparse-mla-impl "$impl" --sparse-mla-require-gpu -n "${XDIST:-4}" -p no:randomly -p no:cacheprovider \
      -q --durations="${DURATIONS:-25}" "${xfail[@]}" >"$OUT/$phase-$impl.log" 2>&1
    rc=$?
    secs=$(python3 -c "import sys; print(round($(date +%s.%N) - $t0, 1))")
    echo "$impl $phase: exit $rc in $secs s; $(tail -1 "$OUT/$phase-$impl.log")"
    python3 - "$OUT/cold.json" "$impl" "$phase" "$secs" "$rc" "$cache" <<'PY'
import collections, json, os, sys
path, impl, phase, secs, rc, cache = sys.argv[1:]
data = json.load(open(path))
entry = data.setdefault(impl, {})
entry[f"{phase}_s"], entry[f"{phase}_exit"] = float(secs), int(rc)
if phase == "cold":
    names = collections.Counter()
    for d in os.listdir(cache):
        for f in os.listdir(os.path.join(cache, d)):
            if f.endswith(".cubin"):
                names[f[: -len(".cubin")]] += 1
    entry["kernels"] = dict(names.most_common())
    entry["variants"] = sum(names.values())
json.dump(data, open(path, "w"), indent=1)
PY
  done
  rm -rf "$cache"
done
cat "$OUT/cold.json"
