set -x
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
python -c "import torch, cutlass; print(torch.__version__)"
python scratch/ws_bench.py deepseek-v3:128,deepseek-v4-flash:128,deepseek-v4-flash:256,glm-5:128,deepseek-v3:32,deepseek-v4-flash:32,deepseek-v3:8 write,read 20 2>&1 | tee $OUT/ws1.log | grep -v Warning
