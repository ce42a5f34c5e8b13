#!/usr/bin/env bash
# compute-sanitizer over the lab's sanitize_case probe (every kernel of the layer as small named cases: `--list`):
# racecheck, memcheck, synccheck and initcheck, one log each under $OUT/sanitize, the kernels compiled with line info
# so every report names source lines. First a plain run (no tool) checks every case's values and fills the kernel
# cache, so the tools' runs load kernels instead of compiling them.
#
#   bash tools/gpu/sanitize.sh                                   # all cases, all four tools (~6 min on an H200)
#   SANITIZE_ARGS="--cases 'ring-*' comm-p2" SANITIZE_TOOLS="racecheck initcheck" bash tools/gpu/sanitize.sh
#
# The driver-API probing of cuda-bindings (cuGetProcAddress) is not an error of ours: --report-api-errors no.
# Verdicts, each tool's exit status included:
#   memcheck / synccheck  an ERROR SUMMARY other than 0 errors fails the step
#   racecheck             a race report the racecheck_filter probe finds unexplained (both lines must name the
#                         synchronisation racecheck cannot see, in a `racecheck-ordered:` comment) fails it
#   initcheck             an uninitialised-access report racecheck_filter --tool initcheck finds unexplained (its
#                         line must say why the read is intended, in an `initcheck-uninit:` comment; a report in no
#                         source of ours, or one cut off by the print limit, is never explained) fails it
# SANITIZE_TIMEOUT bounds each tool's run (s); the plain run's failure fails the step but the tools still run.
set -uo pipefail
cd "$(dirname "$0")/../.."
for p in packages/*/src; do PYTHONPATH="$PWD/$p${PYTHONPATH:+:$PYTHONPATH}"; done
export PYTHONPATH
CASE=(python3 -m gcmoe_lab probe sanitize_case)
FILTER=(python3 -m gcmoe_lab probe racecheck_filter)
OUT=${OUT:-/tmp/gcmoe-gpu-out}/sanitize
mkdir -p "$OUT"
# line info: reports name source lines; SANITIZE_CACHE_DIR lets two runs side by side keep their caches apart
export CUTE_DSL_LINEINFO=1 GCMOE_CACHE_DIR=${SANITIZE_CACHE_DIR:-/tmp/gcmoe-sanitize-cache}
# the explained stage hazards number ~1 M per access pair: keep tracking past the default cap, so that no other
# hazard goes unreported once the cap is reached
export NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS=${NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS:-100000000}
CASE_ARGS=()
eval "CASE_ARGS=(${SANITIZE_ARGS:-})"  # (quoted patterns stay one argument each)
rc=0
"${CASE[@]}" --list "${CASE_ARGS[@]}" | tee "$OUT/cases.txt"
start=$SECONDS
timeout "${SANITIZE_TIMEOUT:-240}" "${CASE[@]}" "${CASE_ARGS[@]}" > "$OUT/plain.log" 2>&1
status=$?
echo "plain: exit $status ($((SECONDS - start)) s); $(tail -1 "$OUT/plain.log")"
[ $status -eq 0 ] || rc=1
for tool in ${SANITIZE_TOOLS:-racecheck memcheck synccheck initcheck}; do
  start=$SECONDS
  timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --report-api-errors no --print-limit 1000 \
    "${CASE[@]}" "${CASE_ARGS[@]}" > "$OUT/$tool.log" 2>&1
  status=$?
  echo "$tool: exit $status ($((SECONDS - start)) s); $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/$tool.log" | tail -1)"
  grep -E "^case |^sanitize_case:" "$OUT/$tool.log" | sed 's/^/  /'
  case "$tool" in
    racecheck|initcheck)
      "${FILTER[@]}" --tool "$tool" "$OUT/$tool.log" | tee "$OUT/$tool-verdict.txt"
      verdict=${PIPESTATUS[0]}
      [ $status -eq 0 ] && [ "$verdict" -eq 0 ] || rc=1 ;;
    *)
      if [ $status -ne 0 ] || ! grep -q "ERROR SUMMARY: 0 errors" "$OUT/$tool.log"; then rc=1; fi ;;
  esac
done
exit $rc
