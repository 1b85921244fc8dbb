# Sourced by the scripts: preload OpenBLAS on Linux when present, so float32 decoding on the
# CPU is memory-bound like on a Mac (the mlx-cpu wheel links the slow reference BLAS).
# The path is specmlx's one constant (specmlx/machine.py), read without importing MLX.
OPENBLAS=$(PYTHONPATH="$(dirname "${BASH_SOURCE[0]}")/.." "${PYTHON:-python3}" -m specmlx.machine 2>/dev/null)
if [ "$(uname -s)" = Linux ] && [ -n "$OPENBLAS" ] && [ -e "$OPENBLAS" ]; then
  export LD_PRELOAD="$OPENBLAS${LD_PRELOAD:+ $LD_PRELOAD}"
fi
