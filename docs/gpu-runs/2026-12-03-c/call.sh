# The device calls of run 2026-12-03-c (README.md: what each folder holds). Every measuring call followed
# `bash .gpu-wheels/a/stash.sh` (carry .gpu-wheels/a) and began with (carry .gpu-wheels/b):
#   source .gpu-wheels/b/install.sh >/dev/null; for p in packages/*/src; do PYTHONPATH=$PWD/$p:$PYTHONPATH; done
#   export PYTHONPATH PYTHONUNBUFFERED=1 GCMOE_CACHE_DIR=/tmp/gcmoe-cache
# Tree: 4afd72d with ablate.patch applied (b/, c/, f/: `git apply docs/gpu-runs/2026-12-03-c/ablate.patch`), then with
# the benchmark's grid-rows fix (d/, e/, f/; d/ without ablate.patch).

# b/ (08:38 UTC): stage ablations, whole GPU and the 116-SM partition
python docs/gpu-runs/2026-12-03-c/stages.py --out $OUT --models deepseek-v3 deepseek-v4-flash glm-4.5 glm-5 \
    --tokens 1 8 32 128 256 --iters 20 2>&1 | tee $OUT/stages.log
# c/ (08:57): W1 stream_k on both placements, the operator's grid rows at T = 1 (stopped at GLM-4.5 T = 8: stream_k
# with its 6 stages does not fit the shared memory there — the script now leaves such a variant out)
python docs/gpu-runs/2026-12-03-c/stages.py --sweep stream_k --out $OUT --models deepseek-v3 deepseek-v4-flash \
    glm-4.5 glm-5 --tokens 1 8 32 128 256 --iters 20 2>&1 | tee $OUT/stream_k.log
# d/ (09:03): #15's benchmark with the grid-rows fix, both flushes
M="deepseek-v3 deepseek-v4-flash glm-5 glm-4.5"
python3 tools/gpu/precompile.py --models $M --tokens 1 8 32 128 256 --kernels-bench
for f in read write; do mkdir -p $OUT/$f; python3 -m gcmoe_gemm_sm90.bench --out $OUT/$f --models $M \
    --tokens 1 8 32 128 256 --no-peers --split-sweep 0 --variants --l2-flush $f; done
# e/ (09:20): GLM-4.5 T = 8 / 32 stream_k (a/), DeepSeek-V3 T = 1 with the 132-SM configuration on 116 SMs (b/)
python docs/gpu-runs/2026-12-03-c/stages.py --sweep stream_k --out $OUT/a --models glm-4.5 --tokens 8 32 --iters 20
python docs/gpu-runs/2026-12-03-c/stages.py --sweep stream_k --out $OUT/b --models deepseek-v3 --tokens 1 --iters 20
# f/ (09:23): the stage ablations at T = 1 with the grid-rows fix
python docs/gpu-runs/2026-12-03-c/stages.py --out $OUT --models deepseek-v4-flash deepseek-v3 glm-5 glm-4.5 \
    --tokens 1 --iters 20 2>&1 | tee $OUT/stages.log
