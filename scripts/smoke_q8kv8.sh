#!/usr/bin/env bash
# sglang-q8kv8-sm90 on an SM90 machine without network, in one call, from the repository root:
#
#   RESULTS=dir bash scripts/smoke_q8kv8.sh
#
# 1. sets up the peers as scripts/peers_env.sh does (carried wheels and files, the plugin) and points
#    SGLang's JIT at CUTLASS (peers_sglang_jit: FlashMLA's, from .peers/flashmla-src.tar.xz);
# 2. builds the kernel with SGLang's own load_jit, timed (scripts/smoke_q8kv8.py): the toolchain it
#    sees, then "BUILD OK" or "BUILD FAILED" with the lines naming a missing header or an nvcc error;
#    the log is $RESULTS/q8kv8-build.log (ptxas's report per kernel), the summary q8kv8-build.json;
#    it stops here when the build failed (exit 1);
# 3. five calls against the float64 oracle and the bundled reference (scripts/peers_smoke.py: the two
#    DSV4 headline shapes, timed, and three conformance cases), errors printed, $RESULTS/smoke-q8kv8.json;
# 4. the conformance run: RESULTS=$RESULTS XDIST=${XDIST:-4} REPRO=${REPRO:-1}
#    bash scripts/device_conformance.sh sglang-q8kv8-sm90 (the module is cached by then, under
#    SGLANG_JIT_CACHE_DIR, so no test pays for the build).
# Needs, carried: .whl/msgspec-0.22.0-cp312-*.whl (SGLang's JIT build spec), .peers/tilelang-site.tar.xz
# (apache-tvm-ffi 0.1.11), .peers/sglang (python scripts/carry_sglang.py: the kernel file, its CUDA
# sources, SGLang's JIT build code) or the sglang wheel, .peers/flashmla-src.tar.xz (CUTLASS); on the
# machine: nvcc, ninja, a CUDA torch. CASES (a regular expression of case names) changes step 3's cases.
set -uo pipefail
OUT=${RESULTS:?set RESULTS to the results directory}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PEERS_ENV_FUNCTIONS_ONLY=1
# ptxas's resource report in the build log; the flag is part of SGLang's build key, so it is exported for
# the conformance run too (its workers then find the module built here instead of building another)
export SGLANG_JIT_LOG_RESOURCE_USAGE=${SGLANG_JIT_LOG_RESOURCE_USAGE:-1}
# shellcheck source=scripts/peers_env.sh
source scripts/peers_env.sh
peers_install_wheels
peers_pythonpath
peers_install_project
peers_sglang_jit || echo "smoke_q8kv8: no CUTLASS from FlashMLA's source; the build uses SGLang's own lookup" >&2

t0=$(date +%s)
python3 scripts/smoke_q8kv8.py --log "$OUT/q8kv8-build.log" --json "$OUT/q8kv8-build.json"
status=$?
echo "smoke_q8kv8: build step took $(( $(date +%s) - t0 )) s (exit $status)"
if [ "$status" -ne 0 ]; then
  echo "smoke_q8kv8: stopping: the kernel did not build; see $OUT/q8kv8-build.log" >&2
  exit 1
fi

python3 scripts/peers_smoke.py --out "$OUT/smoke-q8kv8.json" --impls reference sglang-q8kv8-sm90 \
  --cases "${CASES:-^cf-(peaked-dual-c4|heads-5|h128-peaked-T65-c4)$}" 2>&1 | tee "$OUT/smoke-q8kv8.log"

RESULTS=$OUT XDIST=${XDIST:-4} REPRO=${REPRO:-1} bash scripts/device_conformance.sh sglang-q8kv8-sm90
