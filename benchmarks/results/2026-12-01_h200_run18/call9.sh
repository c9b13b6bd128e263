#!/usr/bin/env bash
# Run 18, call 9: the GGUF's second part.
cat .parts/g3.01 >> /tmp/gguf.asm; ls -l /tmp/gguf.asm
