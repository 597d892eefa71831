#!/usr/bin/env bash
# One device call (run from the repo root on the GPU machine, after scripts/gpu-bundle.sh here):
# the whole GPU suite, the C and candle examples, the Echo planner rows, the GEMM tile-config sweep (both weight layouts),
# the expert-path breakdown, a memcheck of the Echo + expert path graph test and one of the GEMM
# null / misaligned pointer test. Logs under $R (one tarball, refreshed after each step).
set -uo pipefail
R=${R:-${OUT:?set OUT to a folder for the logs}}; BUNDLE=${BUNDLE:-gpu-bundle}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p /tmp/logs /tmp/sweep /tmp/sweep_ekn /tmp/paths /tmp/echo
save() { tar -C /tmp -czf $R/logs.tgz logs sweep sweep_ekn paths echo 2>/dev/null; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader > /tmp/logs/gpu.txt
BUNDLE=$BUNDLE OUT=/tmp/logs timeout 270 bash scripts/gpu-run.sh > /tmp/logs/suite.txt 2>&1; save
cat /tmp/logs/gpu.txt /tmp/logs/suite.txt
T=$BUNDLE/run/tests; B=$BUNDLE/run/bin/capmoe-bench
# The examples: the C ABI from C (a checked grouped GEMM), candle's MoE block on the crate
# (checked against candle's per-expert loop, and timed against it).
timeout 60 $BUNDLE/run/bin/capmoe-c-example --gpu > /tmp/logs/c_example.txt 2>&1; echo "c example rc=$?" >> /tmp/logs/c_example.txt; save; tail -4 /tmp/logs/c_example.txt
CAPMOE_REQUIRE_GPU=1 timeout 150 $BUNDLE/run/bin/candle_moe > /tmp/logs/candle_moe.txt 2>&1; echo "candle_moe rc=$?" >> /tmp/logs/candle_moe.txt; save; cat /tmp/logs/candle_moe.txt
timeout 40 $B --only echo --reps 50 --out /tmp/echo > /tmp/logs/echo_bench.log 2>&1; save; grep -E "\[echo\]|echo_plan" /tmp/logs/echo_bench.log
CFG=sm90-coop,sm90-pingpong,sm90-coop-nocluster,sm90-coop-m256,sm90-pingpong128,sm90-pingpong-wide
timeout 120 $B --shapes dsv3_ep8_fc1,dsv3_ep8_fc2,qwen3moe_fc1,qwen3moe_fc2,decode_fc1 --routing uniform --ops fprop,dgrad,wgrad --configs $CFG --reps 8 --no-paths --out /tmp/sweep > /tmp/logs/sweep.log 2>&1; save
timeout 50 $B --shapes dsv3_ep8_fc1,qwen3moe_fc1,decode_fc1 --routing uniform --ops fprop --weight-layout ekn --configs $CFG --reps 8 --no-paths --out /tmp/sweep_ekn > /tmp/logs/sweep_ekn.log 2>&1; save
timeout 40 $B --shapes decode_fc1 --routing uniform --ops fprop --reps 8 --out /tmp/paths > /tmp/logs/paths.log 2>&1; save
cat /tmp/logs/sweep.log /tmp/logs/sweep_ekn.log | grep -E "capmoe-graph|cublas-dense" | awk -F'|' '{printf "%s|%s|%s|%s\n",$1,$3,$4,$5}' | sed 's/  */ /g'
grep -E "expert_fwd" /tmp/logs/paths.log | sed 's/  */ /g'
CAPMOE_REQUIRE_GPU=1 CAPMOE_ECHO_MOE_REPLAYS=2 timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck $T/echo_moe_gpu --test-threads=1 > /tmp/logs/memcheck.txt 2>&1; echo "memcheck rc=$?" >> /tmp/logs/memcheck.txt; save
tail -3 /tmp/logs/memcheck.txt
# Last (may be cut by the 600 s call limit): the skipped null / misaligned per-expert pointers
# must never be touched, which memcheck checks.
CAPMOE_REQUIRE_GPU=1 timeout 40 /usr/local/cuda/bin/compute-sanitizer --tool memcheck $T/grouped_gemm_gpu --test-threads=1 null_and_misaligned > /tmp/logs/memcheck_gemm.txt 2>&1; echo "memcheck (gemm pointers) rc=$?" >> /tmp/logs/memcheck_gemm.txt; save
tail -3 /tmp/logs/memcheck_gemm.txt
