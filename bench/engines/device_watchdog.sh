#!/usr/bin/env bash
# Host-memory watchdog for a device run (started in the background by engines_compare_device.sh).
# A lease was lost once mid-run with nothing returned (session 23, cause unknown; host memory
# exhausted is one way a machine stops answering), so: every INTERVAL_S seconds append the host's
# and the GPU's memory to LOG; when MemAvailable falls below MIN_MIB, log the largest processes and
# SIGKILL the processes whose command line matches PATTERN (the benchmark's), then exit, so the
# run ends with its results written so far instead of taking the machine down.
#
#   bash bench/engines/device_watchdog.sh LOG [MIN_MIB] [INTERVAL_S] [PATTERN]
set -u
LOG=${1:?LOG file}
MIN_MIB=${2:-8192}
INTERVAL_S=${3:-5}
PATTERN=${4:-python3? -m (bench|verifier_svc|drafter_svc|coordinator|gateway|vllm)}
n=0
while sleep "$INTERVAL_S"; do
  avail=$(awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo)
  if [ $(( n % 6 )) -eq 0 ]; then
    gpu=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | paste -sd, -)
    echo "$(date +%T) host MemAvailable ${avail} MiB, GPU used ${gpu:-?} MiB" >> "$LOG"
  fi
  n=$(( n + 1 ))
  if [ "$avail" -lt "$MIN_MIB" ]; then
    { echo "$(date +%T) MemAvailable ${avail} MiB < ${MIN_MIB}: killing /${PATTERN}/"
      ps -eo pid,rss,args --sort=-rss | head -12 | cut -c1-200; } >> "$LOG"
    pkill -9 -f "$PATTERN"
    exit 1
  fi
done
