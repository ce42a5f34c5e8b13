for pt in deepseek-v3:32 deepseek-v4-flash:128; do
  timeout 240 ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis --section InstructionStats --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python scratch/ws_prof.py $pt > $OUT/ncu_${pt/:/_}.txt 2>&1
  echo "point $pt rc=$?"; grep -cE "Duration" $OUT/ncu_${pt/:/_}.txt
done
