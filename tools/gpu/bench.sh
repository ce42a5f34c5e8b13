#!/usr/bin/env bash
# `gcmoe-lab bench` on the device machine, with the peers when they are there; results under $OUT:
# bench.json, bench.md, bench.png, bench.log (+ peer_dg/ logs of DeepGEMM's build and self-test).
#
#   here, once:   cp -r ../shared/peers .peers                  (git-ignored: carry it, with the CuTe DSL wheels)
#   device call:  source .gpu-wheels/b/install.sh && bash tools/gpu/bench.sh [gcmoe-lab bench options...]
#                 (carry [".gpu-wheels/b", ".peers"] on a fresh machine; see docs on the CuTe DSL wheels)
#   peers only:   bash tools/gpu/bench.sh --setup-peers-only    (DeepGEMM's build + JIT cache stay on the warm machine)
#
# triton_kernels: .peers/triton-kernels-v3.6.0 goes on PYTHONPATH. DeepGEMM: .peers/deepgemm-sm90-megamoe/
# build_and_run.sh `build` then `selftest` (its iostream fix may set LD_PRELOAD, which must precede python); a failed
# self-test hides the built module from the bench (PEER_DG_SRC points nowhere), which then records the peer absent
# instead of risking a crash of the whole run.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gcmoe-gpu-out}
mkdir -p "$OUT"
for p in packages/*/src; do PYTHONPATH="$PWD/$p${PYTHONPATH:+:$PYTHONPATH}"; done
[ -d .peers/triton-kernels-v3.6.0 ] && PYTHONPATH="$PYTHONPATH:$PWD/.peers/triton-kernels-v3.6.0"
export PYTHONPATH PYTHONUNBUFFERED=1 GCMOE_CACHE_DIR=${GCMOE_CACHE_DIR:-/tmp/gcmoe-cache}
DG=.peers/deepgemm-sm90-megamoe/build_and_run.sh
if [ -f "$DG" ]; then
  mkdir -p "$OUT/peer_dg"
  if OUT="$OUT/peer_dg" bash "$DG" build >"$OUT/peer_dg/setup.log" 2>&1 \
      && OUT="$OUT/peer_dg" bash "$DG" selftest >>"$OUT/peer_dg/setup.log" 2>&1; then
    fix=${PEER_DG_WORK:-/tmp/peer_dg}/iostream_fix.env
    # shellcheck disable=SC1090
    [ -f "$fix" ] && . "$fix"
    echo "deepgemm peer: built and self-tested"
  else
    echo "deepgemm peer: build or self-test failed (peer_dg/setup.log): the bench records it as absent"
    export PEER_DG_SRC=/nonexistent/deepgemm-peer-failed-its-selftest
  fi
fi
[ "${1:-}" = "--setup-peers-only" ] && exit 0
python3 -m gcmoe_lab bench --json "$OUT/bench.json" --markdown "$OUT/bench.md" --plot "$OUT/bench.png" "$@" 2>&1 \
  | tee "$OUT/bench.log"
exit "${PIPESTATUS[0]}"
