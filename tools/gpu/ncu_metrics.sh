# The Nsight Compute metrics of the GEMM profiles (sourced by ncu_sm90.sh, ncu_layer.sh and ncu_source.sh): time,
# DRAM bytes and throughput, SM-active cycles against elapsed (ramp-up and wave tails), instruction issue, the ALU /
# FMA / tensor (GMMA) pipes and the warp stall reasons per issued instruction.
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__cycles_active.avg,sm__cycles_elapsed.avg,smsp__issue_active.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,smsp__warps_active.avg.per_cycle_active,smsp__inst_executed.sum
metrics+=,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio
# the layer's W1 and W2 under the ncu_layer probe: two consecutive GEMM launches past its first calls' (one W1 and
# one W2, in either order; the ncu_source probe tells them apart by W2's bf16 stores)
layer_gemms=(--kernel-name regex:gcmoe_gemm --launch-skip 4 --launch-count 2)
