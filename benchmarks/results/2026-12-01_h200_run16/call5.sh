#!/usr/bin/env bash
# Run 16, call 5: the GGUF's second part, appended to /tmp/gguf.asm.
cat .parts/g3.01 >> /tmp/gguf.asm; ls -l /tmp/gguf.asm
