#!/usr/bin/env bash
# compute-sanitizer over tools/gpu/sanitize_case.py: racecheck, memcheck, synccheck, one log each under $OUT/sanitize,
# the kernels compiled with line info, so every report names source lines. The driver-API probing of cuda-bindings
# (cuGetProcAddress) is not an error of ours: --report-api-errors no. memcheck / synccheck: an ERROR SUMMARY other
# than 0 errors fails the step; racecheck: a race report that tools/gpu/racecheck_filter.py finds unexplained (both
# lines must name the synchronisation racecheck cannot see, in a `racecheck-ordered:` comment) fails it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gcmoe-gpu-out}/sanitize
mkdir -p "$OUT"
export CUTE_DSL_LINEINFO=1 GCMOE_CACHE_DIR=/tmp/gcmoe-sanitize-cache  # line info: reports name source lines
# the explained stage hazards number ~1 M per access pair: keep tracking past the default cap, so that no other
# hazard goes unreported once the cap is reached
export NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS=${NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS:-100000000}
rc=0
for tool in ${SANITIZE_TOOLS:-racecheck memcheck synccheck}; do
  timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --report-api-errors no --print-limit 200 \
    python3 tools/gpu/sanitize_case.py ${SANITIZE_ARGS:-} > "$OUT/$tool.log" 2>&1
  status=$?
  echo "$tool: exit $status; $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/$tool.log" | tail -1)"
  if [ "$tool" = racecheck ]; then
    python3 tools/gpu/racecheck_filter.py "$OUT/$tool.log" | tee "$OUT/racecheck-verdict.txt"
    verdict=${PIPESTATUS[0]}
    [ $status -eq 0 ] && [ "$verdict" -eq 0 ] || rc=1
  elif [ $status -ne 0 ] || ! grep -q "ERROR SUMMARY: 0 errors" "$OUT/$tool.log"; then
    rc=1
  fi
done
exit $rc
