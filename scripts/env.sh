# Sourced by the scripts: preload OpenBLAS on Linux when present, so float32 decoding on the
# CPU is memory-bound like on a Mac (the mlx-cpu wheel links the slow reference BLAS).
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
if [ "$(uname -s)" = Linux ] && [ -e "$OPENBLAS" ]; then
  export LD_PRELOAD="$OPENBLAS${LD_PRELOAD:+ $LD_PRELOAD}"
fi
