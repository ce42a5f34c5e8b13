nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee $OUT/ws3.log
python -c "import torch, cutlass; print(torch.__version__, cutlass.__version__)" 2>&1 | tail -1 | tee -a $OUT/ws3.log
for pt in deepseek-v4-flash:32 deepseek-v3:128 deepseek-v4-flash:128 deepseek-v4-flash:256 glm-5:128 deepseek-v3:32 deepseek-v3:8; do
  timeout 120 python scratch/ws_bench.py $pt write 15 2>&1 | grep --line-buffered -v Warning | tee -a $OUT/ws3.log
  echo "point $pt rc=${PIPESTATUS[0]}" | tee -a $OUT/ws3.log
done
