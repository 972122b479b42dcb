#!/usr/bin/env bash
# The whole conformance suite against each peer adapter (and the bundled reference) on one CUDA
# machine, with the results docs/conformance.md is generated from.
#
#   RESULTS=dir bash scripts/device_conformance.sh [IMPL ...]     # from the repository root
#
# IMPLs default to the reference and every peer (pytest_sparse_mla/catalogue.py; LIST=1 prints them
# and exits, no RESULTS needed). Peers come from the carried files listed in scripts/peers_env.sh (a FlashMLA build
# is made in the background from its source when none is carried, while the other implementations run). Per IMPL,
# in $RESULTS:
#   conformance-IMPL.json   --sparse-mla-report-json (probe, options, device per worker)
#   conformance-IMPL.xml    JUnit XML (every test's outcome and message)
#   conformance-IMPL.log    the pytest output
# plus machine.json (GPU, driver, versions, peer sources) and, from scripts/conformance_report.py,
# conformance.json and conformance.md. Shipped xfail files (pytest_sparse_mla/xfail/IMPL.txt) are
# applied unless XFAIL=0. REPRO=1 writes the reproducers of every xfailed or failed call
# (--sparse-mla-repro-dir, in repro/repro-IMPL) and runs them (scripts/check_repros.py: each must fail on its
# implementation and pass on the reference; repro-check.json; REPRO_TIMEOUT, default 300 s, ends the check: what was checked by then is written, every test's first call first). Optional: SMOKE=1 runs scripts/peers_smoke.py (smoke.json), BENCH=1 the
# peer and reference-attention benchmarks (bench/results.json). Variables: XDIST (workers, default 4), SUITE_TIMEOUT
# (seconds per implementation, default 240), TEST_TIMEOUT (seconds per test through pytest-timeout, default auto:
# 120 s on CUDA, x3 for large cases; a kernel that kills the CUDA context or hangs costs its test and its xdist
# worker, which xdist replaces: README "A crash or a hang costs one test"), SMOKE_TIMEOUT (180), SMOKE_MAX_TOKENS (600),
# BENCH_TIMEOUT (240), PEERS_EXT_OUT (pack a fresh FlashMLA build there), SUITES (what pytest collects, default
# suites; e.g. suites/test_attention_search.py), EXTRA_ARGS (more pytest arguments, word-split: the search's GPU budget
# "--sparse-mla-search-examples 40 --sparse-mla-search-seed 1 --sparse-mla-search-shards 4"),
# PACK (write everything in $RESULTS into this one .tar.xz at the end), SANITIZER=1 (run each suite under
# compute-sanitizer memcheck: a test whose kernels access memory out of bounds fails with the first access
# reported, pytest_sparse_mla/sanitizer.py; one process per suite, log in $RESULTS/sanitizer-IMPL.log).
set -uo pipefail
IMPLS=("$@")
if [ ${#IMPLS[@]} -eq 0 ]; then
  mapfile -t IMPLS < <(python3 -m pytest_sparse_mla.catalogue conformance)
  [ ${#IMPLS[@]} -gt 0 ] || { echo "device_conformance: could not read the implementations" >&2; exit 1; }
fi
if [ "${LIST:-0}" = 1 ]; then
  printf '%s\n' "${IMPLS[@]}"
  exit 0
fi
OUT=${RESULTS:?set RESULTS to the results directory}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PEERS_ENV_FUNCTIONS_ONLY=1
# shellcheck source=scripts/peers_env.sh
source scripts/peers_env.sh
t_start=$(date +%s)
stamp() { echo "[device_conformance +$(( $(date +%s) - t_start ))s] $*"; }

peers_install_wheels
peers_pythonpath
peers_install_project
if [[ " ${IMPLS[*]} " == *" sglang-q8kv8-sm90 "* ]]; then
  peers_sglang_jit || true  # CUTLASS for SGLang's JIT build (scripts/peers_env.sh)
fi
PLUGIN=sparse_mla  # the pytest11 entry point; the module itself when the editable install failed
python3 -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'sparse_mla' for e in m.entry_points(group='pytest11')) else 1)" \
  || PLUGIN=pytest_sparse_mla.plugin
TIMEOUT_ARGS=(--sparse-mla-timeout "${TEST_TIMEOUT:-auto}")  # pytest-timeout: in the test extra and the device image
python3 -c "import pytest_timeout" 2>/dev/null \
  || { echo "[device_conformance] pytest-timeout is not installed: no per-test time limit" >&2; TIMEOUT_ARGS=(); }
build_pid=""
if [[ " ${IMPLS[*]} " == *" flashmla "* ]] || [ "${BENCH:-0}" = 1 ] || [ "${SMOKE:-0}" = 1 ]; then
  peers_flashmla >"$OUT/flashmla-setup.log" 2>&1 &
  build_pid=$!
fi


write_machine_json() {
python3 - "$OUT/machine.json" <<'PY'
import json, os, platform, subprocess, sys, time
import torch
info = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "python": platform.python_version(),
        "torch": torch.__version__, "cuda_runtime": torch.version.cuda, "cpu_count": os.cpu_count(),
        "xdist": int(os.environ.get("XDIST", "4"))}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_count=torch.cuda.device_count(), sm=f"{p.major}.{p.minor}",
                gpu_memory_GiB=round(p.total_memory / 2**30, 1))
try:
    info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
except Exception:
    info["driver"] = None
import importlib.metadata as m
for dist in ("sglang", "pytest", "pytest-xdist", "syrupy", "hypothesis"):
    try:
        info[dist] = m.version(dist)
    except m.PackageNotFoundError:
        info[dist] = None
from pytest_sparse_mla.catalogue import sources
for source in sources():  # each peer's source: a version installed, or a file naming it
    if source.file is not None:
        path = source.file.format(PEERS_DIR=os.environ.get("PEERS_DIR", "/tmp/sparse-mla-peers"))
        info[source.key] = open(path).read().strip().splitlines() if os.path.exists(path) else None
    elif source.dist is not None and source.key not in info:
        try:
            info[source.key] = m.version(source.dist)
        except m.PackageNotFoundError:
            info[source.key] = None
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
PY
}

run_suite() {  # run_suite IMPL
  local impl=$1 xfail=() t0
  if [ "${XFAIL:-1}" = 1 ] && [ -f "pytest_sparse_mla/xfail/$impl.txt" ]; then
    xfail=(--sparse-mla-xfail-file "pytest_sparse_mla/xfail/$impl.txt")
  fi
  if [ "${REPRO:-0}" = 1 ]; then
    xfail+=(--sparse-mla-repro-dir "$OUT/repro/repro-$impl")
  fi
  local wrap=()
  local workers=${XDIST:-4}
  if [ "${SANITIZER:-0}" = 1 ]; then  # one process: the sanitizer writes every report to one log
    export SPARSE_MLA_SANITIZER_LOG="$OUT/sanitizer-$impl.log"
    wrap=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --padding 4096 --destroy-on-device-error kernel
          --log-file "$SPARSE_MLA_SANITIZER_LOG")
    workers=0
  fi
  t0=$(date +%s)
  stamp "suite $impl"
  timeout -s INT -k 20 "${SUITE_TIMEOUT:-240}" \
    "${wrap[@]}" python3 -m pytest -p "$PLUGIN" ${SUITES:-suites} --sparse-mla-impl "$impl" --sparse-mla-require-gpu \
      -n "$workers" -p no:randomly -p no:cacheprovider -q -rfEX --tb=line \
      --sparse-mla-report-json "$OUT/conformance-$impl.json" \
      --junitxml "$OUT/conformance-$impl.xml" -o junit_family=xunit2 -o junit_logging=no \
      "${TIMEOUT_ARGS[@]}" "${xfail[@]}" ${EXTRA_ARGS:-} >"$OUT/conformance-$impl.log" 2>&1
  local rc=$?
  local xf=null
  [ "${XFAIL:-1}" = 1 ] && [ -f "pytest_sparse_mla/xfail/$impl.txt" ] && xf="\"pytest_sparse_mla/xfail/$impl.txt\""
  echo "{\"impl\": \"$impl\", \"exit\": $rc, \"seconds\": $(( $(date +%s) - t0 )), \"xfail_file\": $xf}" \
    >"$OUT/conformance-$impl.exit.json"
  stamp "suite $impl: exit $rc in $(( $(date +%s) - t0 )) s; $(tail -1 "$OUT/conformance-$impl.log")"
}

for impl in "${IMPLS[@]}"; do
  [ "$impl" = flashmla ] && continue
  run_suite "$impl"
done
if [ -n "$build_pid" ]; then
  wait "$build_pid"
  stamp "FlashMLA setup: $(tail -2 "$OUT/flashmla-setup.log" | tr '\n' ' ')"
fi
peers_status 2>&1 | sed 's/^/  /'
write_machine_json
if [[ " ${IMPLS[*]} " == *" flashmla "* ]]; then
  run_suite flashmla
fi
if [ "${REPRO:-0}" = 1 ]; then
  stamp "reproducers"
  timeout -s INT "${REPRO_TIMEOUT:-300}" python3 scripts/check_repros.py "$OUT/repro" --jobs "${REPRO_JOBS:-12}" \
    --json "$OUT/repro-check.json" >"$OUT/repro-check.log" 2>&1
  stamp "reproducers: exit $?; $(head -c 1500 "$OUT/repro-check.log" | tr '\n' ' ')"
fi
if [ "${SMOKE:-0}" = 1 ]; then
  stamp "smoke"
  timeout -s INT "${SMOKE_TIMEOUT:-180}" python3 scripts/peers_smoke.py --out "$OUT/smoke.json" \
    --max-tokens "${SMOKE_MAX_TOKENS:-600}" >"$OUT/smoke.log" 2>&1
  stamp "smoke: exit $?; $(grep SUMMARY "$OUT/smoke.log" | tr '\n' ' ' | cut -c1-1500)"
fi
if [ "${BENCH:-0}" = 1 ]; then
  stamp "bench"
  SPARSE_MLA_BENCH_DIR="$OUT/bench" timeout -s INT "${BENCH_TIMEOUT:-240}" python3 -m pytest -p "$PLUGIN" \
    benchmarks/test_bench_peers.py benchmarks/test_bench_attention.py \
    --benchmark-only -p no:xdist -p no:randomly -p no:cacheprovider --sparse-mla-require-gpu -q -rs \
    >"$OUT/bench.log" 2>&1
  stamp "bench: exit $?; $(tail -1 "$OUT/bench.log")"
fi
python3 scripts/conformance_report.py "$OUT" --json "$OUT/conformance.json" --md "$OUT/conformance.md" \
  >"$OUT/report.log" 2>&1 || stamp "report failed: $(tail -3 "$OUT/report.log")"
if [ -n "${PACK:-}" ]; then
  tar -C "$OUT" --exclude=inputs.pt -cf - . | xz -T0 -6 >"$PACK" && stamp "packed $(du -h "$PACK" | cut -f1) to $PACK"
fi
stamp "done"
