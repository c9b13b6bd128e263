#!/usr/bin/env bash
# Run 20, call 3b (carries the GGUF's second part, right after call 3): appends it.
cat .parts/g3.01 >> /tmp/gguf.asm; ls -la /tmp/gguf.asm
