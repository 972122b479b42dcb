# Make the peers importable for `--sparse-mla-impl sglang-*|flashmla|...` on a CUDA
# machine without network access. Source it from the repository root:
#
#     source scripts/peers_env.sh
#
# What it uses (carried next to the checkout; both folders are git-ignored):
#   .whl/sglang-0.5.23-cp312-*.whl   the SGLang wheel for the target Python (pip download --no-deps
#                                    sglang==0.5.23); installed --no-deps into $PEERS_DIR/site: the
#                                    adapters execute two of its files and never import `sglang`
#   .whl/*.whl                        other wheels the run needs (syrupy for the golden suite; for
#                                    the TileLang peers: SGLang's pins tilelang==0.1.12 and
#                                    apache-tvm-ffi==0.1.11, with torch-c-dlpack-ext==0.1.5 and
#                                    z3-solver==4.15.4.0 (sglang-dsa-tilelang is judged with them;
#                                    sglang-dsv4-tilelang's kernel compiles for sm_90 under neither
#                                    0.1.12 nor 0.1.15, so its adapter skips there);
#                                    pip download --no-deps --only-binary=:all: --python-version 3.12
#                                    --implementation cp --platform manylinux_2_28_x86_64 ...; about 83 MB)
#   .peers/*-site.tar.xz              already-unpacked wheels, xz-compressed, unpacked into $PEERS_DIR/site
#                                    (the four TileLang wheels above fit a 64 MiB carry only this way:
#                                    about 38 MB; z3's libz3.so once, libz3.so.4.15 a link to it, its
#                                    .data copy left out); made from the wheels with
#                                    d=$(mktemp -d); for w in *.whl; do unzip -q -o -d "$d" "$w"; done;
#                                    tar -C "$d" -cf - . | xz -T0 -8 > .peers/tilelang-site.tar.xz
#   .peers/sglang/                    instead of the SGLang wheel: the files of it the adapters execute and
#                                    its METADATA (python scripts/carry_sglang.py), put on PYTHONPATH
#   .peers/flash_mla-ext.tar.xz       a FlashMLA build (flash_mla/ with its cuda*.so, PEER_SOURCE.txt),
#                                    unpacked into $PEERS_DIR/flashmla; without it FlashMLA is built from
#   .peers/flashmla-src.tar.xz        FlashMLA's source with CUTLASS's include trees (FlashMLA/):
#                                    FLASH_MLA_DISABLE_SM100=1 python setup.py build_ext --inplace
#                                    (about 2 minutes on 16 cores); with PEERS_EXT_OUT=DIR set, the
#                                    build is packed to DIR/flash_mla-ext.tar.xz to be carried next time
#                                    peers_sglang_jit unpacks only its csrc/cutlass/include (CUTLASS 147f5673,
#                                    4.3.5) into $PEERS_DIR/sglang-jit-cutlass and exports
#                                    SPARSE_MLA_SGLANG_CUTLASS=<that include dir>: SGLang's JIT build of
#                                    sglang-q8kv8-sm90 (load_jit, extra_dependencies=["cutlass"]) finds CUTLASS
#                                    only in an installed FlashInfer's or DeepGEMM's package data, and the
#                                    adapter's stand-in for that lookup (_source.stubs_for("sglang-q8kv8"))
#                                    answers this variable instead when it is set (an already set variable is
#                                    kept); it also sets SGLANG_JIT_CACHE_DIR (default
#                                    $PEERS_DIR/sglang-jit-cache), where the built module is cached. The
#                                    build also needs nvcc, ninja, apache-tvm-ffi (from
#                                    .peers/tilelang-site.tar.xz) and msgspec (.whl/msgspec-0.22.0-cp312-*.whl)
#   .peers/flaggems/src/flag_gems/    FlagGems' two source files (fused/flash_mla_with_kvcache.py,
#                                    fused/flashmla_sparse.py; git show of flagos-ai/FlagGems) and a
#                                    _version.py naming the commit: put on PYTHONPATH (flaggems)
#   .peers/vllm/vllm/                 vLLM's v1/attention/ops/xpu_mla_sparse.py (vllm-triton)
#   .peers/flashinfer/flashinfer/     the two reference files of the flashinfer-python wheel
#                                    (flashinfer-reference), when the wheel itself is not installed
# and installs this checkout (`pip install --no-deps -e .`: the pytest11 entry point behind
# `-p sparse_mla`). Variables: PEERS_DIR (default /tmp/sparse-mla-peers), PEERS_EXT_OUT,
# MAX_JOBS (16), NVCC_THREADS (2). With PEERS_ENV_FUNCTIONS_ONLY=1 it only defines the functions
# (scripts/device_conformance.sh builds FlashMLA in the background while other suites run).

export PEERS_DIR=${PEERS_DIR:-/tmp/sparse-mla-peers}
PEERS_ROOT=$(pwd)

peers_log() { echo "peers_env: $*" >&2; }

peers_install_wheels() {  # every carried wheel, one at a time (one bad wheel does not stop the rest)
  mkdir -p "$PEERS_DIR/site"
  local w
  for w in .whl/*.whl; do
    [ -f "$w" ] || continue
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$PEERS_DIR/site" "$w" >/dev/null 2>&1 || peers_log "could not install $w"
  done
  for w in .peers/*-site.tar.xz; do  # unpacked wheels (the TileLang stack), see the header; once per $PEERS_DIR
    [ -f "$w" ] || continue
    [ -f "$PEERS_DIR/site/.$(basename "$w").done" ] && continue
    tar -xJf "$w" -C "$PEERS_DIR/site" && touch "$PEERS_DIR/site/.$(basename "$w").done" \
      || peers_log "could not unpack $w"
  done
}

peers_pythonpath() {  # the carried source directories: pytest_sparse_mla/catalogue.py
  local p="$PEERS_ROOT:$PEERS_DIR/site:$PEERS_DIR/flashmla" d
  while read -r d; do
    [ -n "$d" ] && [ -d "$PEERS_ROOT/$d" ] && p="$p:$PEERS_ROOT/$d"
  done < <(cd "$PEERS_ROOT" && python3 -m pytest_sparse_mla.catalogue carried)
  export PYTHONPATH="$p${PYTHONPATH:+:$PYTHONPATH}"
}

peers_install_project() {
  python3 -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'sparse_mla' for e in m.entry_points(group='pytest11')) else 1)" 2>/dev/null \
    || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || peers_log "pip install -e . failed: load the plugin with -p pytest_sparse_mla.plugin"
}

peers_flashmla() {  # unpack a carried build, else build from the carried source
  mkdir -p "$PEERS_DIR/flashmla"
  if [ -f .peers/flash_mla-ext.tar.xz ]; then
    tar -xJf .peers/flash_mla-ext.tar.xz -C "$PEERS_DIR/flashmla"
    peers_log "FlashMLA: unpacked the carried build ($(head -1 "$PEERS_DIR/flashmla/PEER_SOURCE.txt" 2>/dev/null))"
    return 0
  fi
  if [ ! -f .peers/flashmla-src.tar.xz ]; then
    peers_log "FlashMLA: no .peers/flash_mla-ext.tar.xz or .peers/flashmla-src.tar.xz; the flashmla adapter will skip"
    return 1
  fi
  local src="$PEERS_DIR/flashmla-src" cuda_home t0
  rm -rf "$src" && mkdir -p "$src" && tar -xJf .peers/flashmla-src.tar.xz -C "$src"
  cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
  t0=$(date +%s)
  if ( cd "$src/FlashMLA" \
       && CUDA_HOME=$cuda_home CPLUS_INCLUDE_PATH="$cuda_home/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
          FLASH_MLA_DISABLE_SM100=1 MAX_JOBS=${MAX_JOBS:-16} NVCC_THREADS=${NVCC_THREADS:-2} \
          python3 setup.py build_ext --inplace >"$PEERS_DIR/flashmla-build.log" 2>&1 ) \
     && compgen -G "$src/FlashMLA/flash_mla/cuda*.so" >/dev/null; then
    peers_log "FlashMLA: built in $(( $(date +%s) - t0 )) s"
  else
    peers_log "FlashMLA: build failed after $(( $(date +%s) - t0 )) s; tail of $PEERS_DIR/flashmla-build.log:"
    tail -30 "$PEERS_DIR/flashmla-build.log" >&2
    return 1
  fi
  cp -r "$src/FlashMLA/flash_mla" "$src/FlashMLA/PEER_SOURCE.txt" "$PEERS_DIR/flashmla/"
  if [ -n "${PEERS_EXT_OUT:-}" ]; then
    mkdir -p "$PEERS_EXT_OUT"
    tar -C "$PEERS_DIR/flashmla" -cf - flash_mla PEER_SOURCE.txt | xz -T0 -6 >"$PEERS_EXT_OUT/flash_mla-ext.tar.xz"
    peers_log "FlashMLA: packed $(du -h "$PEERS_EXT_OUT/flash_mla-ext.tar.xz" | cut -f1) to $PEERS_EXT_OUT/flash_mla-ext.tar.xz"
  fi
}

peers_sglang_jit() {  # CUTLASS for SGLang's JIT build of sglang-q8kv8-sm90 (see the header)
  export SGLANG_JIT_CACHE_DIR=${SGLANG_JIT_CACHE_DIR:-$PEERS_DIR/sglang-jit-cache}
  if [ -n "${SPARSE_MLA_SGLANG_CUTLASS:-}" ]; then
    peers_log "sglang JIT: CUTLASS from SPARSE_MLA_SGLANG_CUTLASS=$SPARSE_MLA_SGLANG_CUTLASS"
    return 0
  fi
  local dest="$PEERS_DIR/sglang-jit-cutlass"
  if [ ! -f "$dest/.done" ]; then
    if [ ! -f .peers/flashmla-src.tar.xz ]; then
      peers_log "sglang JIT: no .peers/flashmla-src.tar.xz; sglang-q8kv8-sm90 builds only with FlashInfer's or DeepGEMM's CUTLASS installed"
      return 1
    fi
    rm -rf "$dest" && mkdir -p "$dest" \
      && tar -xJf .peers/flashmla-src.tar.xz -C "$dest" FlashMLA/csrc/cutlass/include FlashMLA/PEER_SOURCE.txt \
      && touch "$dest/.done" \
      || { peers_log "sglang JIT: could not unpack CUTLASS from .peers/flashmla-src.tar.xz"; return 1; }
  fi
  export SPARSE_MLA_SGLANG_CUTLASS="$dest/FlashMLA/csrc/cutlass/include"
  peers_log "sglang JIT: CUTLASS of $(head -1 "$dest/FlashMLA/PEER_SOURCE.txt" 2>/dev/null) at $SPARSE_MLA_SGLANG_CUTLASS"
}

peers_status() {
  python3 - <<'PY' >&2 || true
import importlib.metadata as m
from pytest_sparse_mla import catalogue
from pytest_sparse_mla.implementations import BUILTINS
for name in catalogue.peer_names():
    impl = BUILTINS[name](None)
    print(f"peers_env: {name}: {impl.skip_reason('sparse_mla_forward', 'cuda') or 'ready'}")
try:
    print("peers_env: sglang", m.version("sglang"))
except m.PackageNotFoundError:
    print("peers_env: sglang not installed")
PY
}

if [ "${PEERS_ENV_FUNCTIONS_ONLY:-0}" != "1" ]; then
  peers_install_wheels
  peers_flashmla
  peers_sglang_jit
  peers_pythonpath
  peers_install_project
  peers_status
fi
